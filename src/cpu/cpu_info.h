// Facts about the host. The public ones (CPU model and features, the code paths taken, NUMA,
// huge pages, memory, usable cores) are strata/system_info.h; here, what only strata's own
// layers use: library versions and the memory figures the RAM plan and the trainer's report
// read.
#pragma once

#include <cstddef>
#include <vector>

#include "strata/build_info.h"
#include "strata/system_info.h"

namespace strata::cpu {

// oneDNN, oneTBB and hwloc versions as the loaded libraries report them.
std::vector<ComponentVersion> component_versions();

// What this process may still take of the host's RAM: MemAvailable, or less where the process's
// cgroup (v2) sets memory.max (its limit less memory.current). 0 when unknown. (With
// STRATA_TEST_MEMINFO set, MemAvailable of that file alone.)
std::size_t ram_available_bytes();
// This process's peak resident memory so far (getrusage).
std::size_t process_peak_rss_bytes();

}  // namespace strata::cpu
