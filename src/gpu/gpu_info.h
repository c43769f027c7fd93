// Facts about the CUDA side. The visible devices and the loaded CUDA libraries are public
// (strata/system_info.h); here, the versions strata/build_info.h's component_versions gathers.
// Safe to call in every build (without CUDA compiled in, without the CUDA libraries, or without
// a driver, they say so).
#pragma once

#include <vector>

#include "strata/build_info.h"
#include "strata/system_info.h"

namespace strata::gpu {

// cuda runtime, cuda driver, cublas, nccl; "not built" / "not found" / "no driver" where absent.
std::vector<ComponentVersion> component_versions();

}  // namespace strata::gpu
