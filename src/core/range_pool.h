// RangePool: best-fit placement of blocks in segments, with splitting and coalescing. The one
// placement rule of both devices' allocators: the CPU-emulated device's arena (one segment, the
// whole cap) and the CUDA device's caching allocator (a segment per cudaMalloc), so a plan or a
// strata-prof prediction calibrated on the emulated device meets the same fragmentation on a GPU.
//
// Offsets are virtual: segment k covers [base_k, base_k + size_k), and the next segment starts
// one gap past its end, so a free range never merges across two segments (their memory is not
// contiguous). Large blocks (>= small_limit) go best-fit from the bottom: the smallest free range
// that fits, split, the rest stays free. Small ones are carved from the top of the highest free
// range that fits, so short-lived buffers (activations) do not cut the space the large ones need
// (a layer's gathered weights, its gradient) into pieces; GPU caching allocators keep separate
// small and large pools for the same reason. Not thread-safe: the owner's lock guards it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <set>
#include <utility>
#include <vector>

namespace strata::detail {

class RangePool {
 public:
  static constexpr std::size_t kNone = SIZE_MAX;

  explicit RangePool(std::size_t small_limit, std::size_t gap = 512)
      : small_(small_limit), gap_(gap) {}

  // Adds a segment of `size` bytes, all free; returns its base offset.
  std::size_t add_segment(std::size_t size) {
    const std::size_t base = next_base_;
    next_base_ += size + gap_;
    segments_[base] = size;
    free_bytes_ += size;
    insert_free(base, size);
    return base;
  }
  // The base and size of the segment holding `offset`.
  std::pair<std::size_t, std::size_t> segment_of(std::size_t offset) const {
    auto it = std::prev(segments_.upper_bound(offset));
    return {it->first, it->second};
  }
  // Removes the segments that are wholly free; returns their (base, size).
  std::vector<std::pair<std::size_t, std::size_t>> take_free_segments() {
    std::vector<std::pair<std::size_t, std::size_t>> out;
    for (auto it = segments_.begin(); it != segments_.end();) {
      auto f = free_by_off_.find(it->first);
      if (f == free_by_off_.end() || f->second != it->second) {
        ++it;
        continue;
      }
      erase_free(f->first, f->second);
      free_bytes_ -= it->second;
      out.push_back(*it);
      it = segments_.erase(it);
    }
    return out;
  }

  // The offset of a new block of `size` bytes, or kNone when no free range is large enough.
  std::size_t alloc(std::size_t size) {
    if (size == 0) return kNone;
    if (size < small_) {
      for (auto it = free_by_off_.rbegin(); it != free_by_off_.rend(); ++it) {
        if (it->second < size) continue;
        const std::size_t off = it->first, fsize = it->second;
        erase_free(off, fsize);
        if (fsize > size) insert_free(off, fsize - size);
        return taken(off + fsize - size, size);
      }
      return kNone;
    }
    auto it = free_by_size_.lower_bound({size, 0});
    if (it == free_by_size_.end()) return kNone;
    const auto [fsize, off] = *it;
    erase_free(off, fsize);
    if (fsize > size) insert_free(off + size, fsize - size);
    return taken(off, size);
  }
  // Returns a block; it merges with the free ranges beside it in its segment.
  void free(std::size_t off, std::size_t size) {
    free_bytes_ += size;
    auto next = free_by_off_.lower_bound(off);
    if (next != free_by_off_.end() && off + size == next->first) {
      size += next->second;
      free_by_size_.erase({next->second, next->first});
      next = free_by_off_.erase(next);
    }
    if (next != free_by_off_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == off) {
        off = prev->first;
        size += prev->second;
        free_by_size_.erase({prev->second, prev->first});
        free_by_off_.erase(prev);
      }
    }
    insert_free(off, size);
  }

  std::size_t largest_free() const {
    return free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first;
  }
  std::size_t free_bytes() const { return free_bytes_; }
  std::size_t free_ranges() const { return free_by_off_.size(); }
  std::size_t segments() const { return segments_.size(); }
  // The highest end of a block ever placed, as a virtual offset (one segment: bytes touched).
  std::size_t high_water() const { return high_water_; }
  std::size_t small_limit() const { return small_; }

 private:
  std::size_t taken(std::size_t off, std::size_t size) {
    free_bytes_ -= size;
    if (off + size > high_water_) high_water_ = off + size;
    return off;
  }
  void insert_free(std::size_t off, std::size_t size) {
    free_by_off_[off] = size;
    free_by_size_.insert({size, off});
  }
  void erase_free(std::size_t off, std::size_t size) {
    free_by_off_.erase(off);
    free_by_size_.erase({size, off});
  }

  std::size_t small_, gap_;
  std::size_t next_base_ = 0;
  std::size_t free_bytes_ = 0;
  std::size_t high_water_ = 0;
  std::map<std::size_t, std::size_t> segments_;                 // base -> size
  std::map<std::size_t, std::size_t> free_by_off_;              // offset -> size
  std::set<std::pair<std::size_t, std::size_t>> free_by_size_;  // (size, offset)
};

}  // namespace strata::detail
