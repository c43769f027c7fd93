#include "core/interrupt_files.h"

#include <unistd.h>

#include <atomic>
#include <cstring>

namespace strata::core {
namespace {

constexpr int kSlots = 64;
constexpr std::size_t kPathMax = 4096;
struct Slot {
  std::atomic<bool> claimed{false}, published{false};
  char path[kPathMax];
};
Slot g_slots[kSlots];

}  // namespace

int remove_file_on_interrupt(const std::string& path) {
  if (path.size() >= kPathMax) return -1;
  for (int i = 0; i < kSlots; ++i) {
    bool expected = false;
    if (!g_slots[i].claimed.compare_exchange_strong(expected, true)) continue;
    std::memcpy(g_slots[i].path, path.c_str(), path.size() + 1);
    g_slots[i].published.store(true);
    return i;
  }
  return -1;
}

void forget_interrupt_file(int slot) noexcept {
  if (slot < 0 || slot >= kSlots) return;
  g_slots[slot].published.store(false);
  g_slots[slot].claimed.store(false);
}

void remove_interrupt_files() noexcept {
  for (Slot& slot : g_slots)
    if (slot.published.load()) ::unlink(slot.path);
}

}  // namespace strata::core
