#include "core/process.h"

#include <fmt/format.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <thread>

#include "strata/system_info.h"

namespace strata {

std::string this_host() {
  char name[256] = {};
  return ::gethostname(name, sizeof name - 1) == 0 ? std::string(name) : std::string("?");
}

std::uint64_t address_space_limit() {
  rlimit r{};
  if (::getrlimit(RLIMIT_AS, &r) != 0 || r.rlim_cur == RLIM_INFINITY) return 0;
  return std::uint64_t(r.rlim_cur);
}

std::uint64_t address_space_used() {
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);)
    if (line.starts_with("VmSize:")) return std::strtoull(line.c_str() + 7, nullptr, 10) << 10;
  return 0;
}

std::uint64_t address_space_headroom() {
  rlimit st{};
  std::uint64_t stack = std::uint64_t(8) << 20;
  if (::getrlimit(RLIMIT_STACK, &st) == 0 && st.rlim_cur != RLIM_INFINITY)
    stack = std::uint64_t(st.rlim_cur);
  const std::uint64_t threads = std::max(1u, std::thread::hardware_concurrency());
  return (std::uint64_t(512) << 20) + threads * (stack + (std::uint64_t(64) << 20));
}

std::string address_space_note() {
  const std::uint64_t limit = address_space_limit();
  if (limit == 0) return {};
  return fmt::format(
      "; the process's address-space limit (`ulimit -v`) is {} MiB, and it counts address space "
      "reserved and not yet used (each thread's stack, the emulated device's whole capacity): "
      "raise it (`ulimit -v unlimited`)",
      limit >> 20);
}

bool process_gone(long pid) { return pid > 0 && ::kill(pid_t(pid), 0) != 0 && errno == ESRCH; }

}  // namespace strata
