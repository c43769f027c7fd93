// Whether io_uring can be used here (old kernels and seccomp profiles forbid it).
#pragma once

#include <string>

namespace strata::nvme {

struct UringProbe {
  bool available = false;
  std::string reason;   // why not, with the errno text
  std::string version;  // liburing version compiled against
};
// Creates and destroys a small ring once; cached after the first call.
UringProbe probe_io_uring();

}  // namespace strata::nvme
