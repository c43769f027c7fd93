// What this build of strata contains and which library versions it runs against.
#pragma once

#include <string>
#include <vector>

namespace strata {

struct ComponentVersion {
  std::string name;     // "cuda", "nccl", "liburing", "onednn", "tbb", "hwloc", ...
  std::string version;  // "not built" where the component is not compiled in
};

std::string strata_version();
bool built_with_cuda();
// Versions of the libraries strata is linked with, as they report themselves at run time.
std::vector<ComponentVersion> component_versions();

}  // namespace strata
