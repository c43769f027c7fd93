// Facts about processes that files left on disk name: whose a half-written checkpoint or a swap
// folder is, and whether that owner is gone.
#pragma once

#include <string>

#include "strata/system_info.h"  // this_host

namespace strata {

// Whether the process `pid` of this host no longer exists (kill(pid, 0) says ESRCH). False for a
// live process, one of another user's (EPERM), or a pid <= 0.
bool process_gone(long pid);

}  // namespace strata
