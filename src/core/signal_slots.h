// Paths a signal handler reads without a lock or an allocation: a fixed table of slots, each
// claimed, filled, then published by the thread that registers a path, and unpublished before it
// is reused. The handler walks the published ones (for_each_published) and may call only
// async-signal-safe functions on them. Used for the files an interrupted process removes
// (core/interrupt_files, the NVMe swap files) and for the data files mapped for reading (a SIGBUS
// in one names it).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace strata::core {

template <int Slots, std::size_t PathMax>
class SignalSlots {
 public:
  // What a path's slot may hold beside it: the address range [begin, end) it names (a mapping).
  struct Range {
    std::uintptr_t begin = 0, end = 0;
  };

  // The slot now holding `path`, or -1 when every slot is taken or the path is too long for a
  // slot; with `cut_long`, a long path is cut to fit instead (one only shown, never unlinked).
  int publish(std::string_view path, Range range = {}, bool cut_long = false) noexcept {
    if (path.size() >= PathMax && !cut_long) return -1;
    const std::size_t n = std::min(path.size(), PathMax - 1);
    for (int i = 0; i < Slots; ++i) {
      Slot& slot = slots_[i];
      bool expected = false;
      if (!slot.claimed.compare_exchange_strong(expected, true)) continue;
      std::memcpy(slot.path, path.data(), n);
      slot.path[n] = '\0';
      slot.begin.store(range.begin);
      slot.end.store(range.end);
      slot.published.store(true);
      return i;
    }
    return -1;
  }

  // Frees a slot publish returned (-1: nothing).
  void unpublish(int slot) noexcept {
    if (slot < 0 || slot >= Slots) return;
    slots_[slot].published.store(false);
    slots_[slot].claimed.store(false);
  }

  // The published slot whose range begins at `begin`, or -1.
  int find(std::uintptr_t begin) const noexcept {
    for (int i = 0; i < Slots; ++i)
      if (slots_[i].published.load() && slots_[i].begin.load() == begin) return i;
    return -1;
  }

  // f(path, range) for each published slot; f returns false to stop. Async-signal-safe when f is.
  template <class F>
  void for_each_published(F&& f) const noexcept {
    for (const Slot& slot : slots_) {
      if (!slot.published.load()) continue;
      if (!f(static_cast<const char*>(slot.path), Range{slot.begin.load(), slot.end.load()}))
        return;
    }
  }

 private:
  struct Slot {
    std::atomic<bool> claimed{false}, published{false};
    std::atomic<std::uintptr_t> begin{0}, end{0};
    char path[PathMax];
  };
  Slot slots_[Slots];
};

}  // namespace strata::core
