#include "text/mapped_file.h"

#include <fmt/format.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <mutex>

#include "core/signal_slots.h"
#include "strata/error.h"

namespace strata::text {
namespace {

// The live mappings. More mappings than slots are made all the same, only not named by the
// handler.
core::SignalSlots<1024, 1024> g_maps;
struct sigaction g_old {};  // the handler replaced, written once before ours is installed
std::once_flag g_install;

void write_str(const char* s) { (void)!::write(2, s, std::strlen(s)); }

extern "C" void on_bus_error(int sig, siginfo_t* info, void* context) {
  const auto at = reinterpret_cast<std::uintptr_t>(info ? info->si_addr : nullptr);
  g_maps.for_each_published([at](const char* path, auto range) {
    if (at < range.begin || at >= range.end) return true;
    write_str("\nstrata: ");
    write_str(path);
    write_str(
        " became shorter while it was read (truncated or written over in place during the run; "
        "`cp` onto it does that): the run cannot go on. Put the file back as it was and "
        "--resume from the newest checkpoint; to change the data of a run, write the new file "
        "under another name and `mv` it into place (a rename leaves the open file whole)\n");
    return false;
  });
  // The handler before ours (strata-train's removes the swap files and ends the process by the
  // signal), else the default: returning re-runs the faulting read, which then ends the process.
  if ((g_old.sa_flags & SA_SIGINFO) && g_old.sa_sigaction != nullptr) {
    g_old.sa_sigaction(sig, info, context);
  } else if (g_old.sa_handler != SIG_DFL && g_old.sa_handler != SIG_IGN &&
             g_old.sa_handler != nullptr) {
    g_old.sa_handler(sig);
  } else {
    // A fault re-runs and ends the process; a SIGBUS sent by kill ends it here.
    ::signal(sig, SIG_DFL);
    ::raise(sig);
  }
}

void install_handler() {
  struct sigaction sa {};
  sa.sa_sigaction = on_bus_error;
  sa.sa_flags = SA_SIGINFO;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGBUS, &sa, &g_old);
}

}  // namespace

const std::uint8_t* map_data_file(int fd, std::size_t size, const std::string& path) {
  std::call_once(g_install, install_handler);
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  if (p == MAP_FAILED)
    detail::throw_errno(__FILE__, __LINE__, "mmap", errno, fmt::format("cannot map {}", path));
  const auto* base = static_cast<const std::uint8_t*>(p);
  const auto b = reinterpret_cast<std::uintptr_t>(base);
  g_maps.publish(path, {b, b + size}, /*cut_long=*/true);
  return base;
}

void unmap_data_file(const std::uint8_t* base, std::size_t size) noexcept {
  if (base == nullptr) return;
  g_maps.unpublish(g_maps.find(reinterpret_cast<std::uintptr_t>(base)));
  ::munmap(const_cast<std::uint8_t*>(base), size);
}

}  // namespace strata::text
