#include "core/interrupt_files.h"

#include <unistd.h>

#include "core/signal_slots.h"

namespace strata::core {
namespace {

SignalSlots<256, 4096> g_files;  // a save of a few hundred shards

}  // namespace

int remove_file_on_interrupt(const std::string& path) { return g_files.publish(path); }

void forget_interrupt_file(int slot) noexcept { g_files.unpublish(slot); }

void remove_interrupt_files() noexcept {
  g_files.for_each_published([](const char* path, auto) {
    ::unlink(path);
    return true;
  });
}

}  // namespace strata::core
