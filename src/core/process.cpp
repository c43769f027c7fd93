#include "core/process.h"

#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>

namespace strata {

std::string this_host() {
  char name[256] = {};
  return ::gethostname(name, sizeof name - 1) == 0 ? std::string(name) : std::string("?");
}

bool process_gone(long pid) { return pid > 0 && ::kill(pid_t(pid), 0) != 0 && errno == ESRCH; }

}  // namespace strata
