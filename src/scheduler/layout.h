// Where each fetch unit's pieces live: the one rule that Engine::finalize lays the units out
// by, and that the memory planner and the perf model follow. Kept in one place so that the
// plan's bytes, the model's replay and the engine's allocations cannot drift apart.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "strata/engine_config.h"

namespace strata::detail {

// Each unit's flat buffer is padded to a multiple of world * kShardAlign elements, so every
// rank's shard is a whole number of 4 KiB pages of bf16 (the smallest useful I/O).
constexpr std::uint64_t kShardAlign = 2048;

std::uint64_t padded_numel(std::uint64_t numel, int world);

// The elements of one optimizer sub-group (zero_optimization.sub_group_size rounded down to
// whole kShardAlign pages, at least one): the host optimizer steps a unit's shard in ranges of
// this many elements, and NVMe-tier state and weights are stored one range per key, so every
// pinned buffer on the optimizer's path holds one range, not the whole unit.
std::uint64_t sub_group_elems(const EngineConfig& c);
// A unit's fp32 optimizer state off the device is one block, master | m | v: the host tier's for
// the whole shard (n = shard), the NVMe tier's one record per sub-group (n = its elements). Each
// array takes state_stride(n) elements: n, or n plus 64 KiB of gap (kStateGapElems) a time until
// no stride of 1 to 6 of them lies within 64 KiB of a multiple of 64 MiB. The CPU AdamW streams
// up to seven arrays together — the three, the early step's second copy of them and the
// gradient, blocks the pinned pool places side by side when it can — and arrays a multiple of
// 128 MiB apart ran it at half the speed or less (AMD EPYC Zen 5, 2026-12: a unit of 8192 x 8192,
// docs/benchmarks.md#engine); 64 MiB apart was at times slower too.
constexpr std::uint64_t kStateGapElems = 16384;
std::uint64_t state_stride(std::uint64_t n);
// The block's elements: master, m and v, each with the gap after it.
inline std::uint64_t state_elems(std::uint64_t n) { return 3 * state_stride(n); }
// The bytes the gaps add to a unit's optimizer state of `shard` elements, stepped in sub-groups
// of `sg`, on `tier`: on the host one block, on NVMe one record a sub-group, on the device none.
std::uint64_t state_gap_bytes(std::uint64_t shard, std::uint64_t sg, Tier tier);
// A rank's share of one gradient bucket (zero_optimization.reduce_bucket_size / world, rounded
// down to whole kShardAlign pages, at least one): the reducer reduce-scatters and accumulates a
// unit's gradient this many shard elements at a time.
std::uint64_t bucket_share_elems(const EngineConfig& c, int world);
// Whether the reducer reduce-scatters a unit of `shard` elements a rank bucket by bucket —
// each bucket's input gathered side by side (world * share elements) into its own output
// (share) — rather than in one reduce-scatter into a shard-sized output: only with more than
// one rank, and where it takes less device memory. Either way the gradient reaches the host
// (and is accumulated) a bucket's share at a time.
inline bool bucketed_reduce(std::uint64_t shard, std::uint64_t share, int world) {
  return world > 1 && (std::uint64_t(world) + 1) * share < shard;
}
// Piece `g` of a shard of `shard` elements cut every `sg` (a sub-group, a bucket's share): its
// first element and its length.
struct Range {
  std::uint64_t first = 0, size = 0;
};
inline std::uint64_t num_pieces(std::uint64_t shard, std::uint64_t sg) {
  return (shard + sg - 1) / sg;
}
inline Range piece(std::uint64_t shard, std::uint64_t sg, std::uint64_t g) {
  const std::uint64_t first = g * sg;
  return {first, shard - first < sg ? shard - first : sg};
}

// The NVMe keys of a unit's gradient shard (a gradient on the NVMe tier): the shard cut at every
// sub-group (`sg`) and every bucket-share (`share`) boundary, so each key lies inside one bucket,
// which the reducer writes (and reads back to accumulate into), and inside one sub-group, which
// the optimizer reads. The pieces of `r` — a bucket or a sub-group of that shard — in order. All
// are whole kShardAlign pages when `sg` and `share` are.
inline std::vector<Range> grad_pieces(Range r, std::uint64_t sg, std::uint64_t share) {
  std::vector<Range> out;
  const std::uint64_t end = r.first + r.size;
  for (std::uint64_t at = r.first; at < end;) {
    const std::uint64_t next = std::min({(at / sg + 1) * sg, (at / share + 1) * share, end});
    out.push_back({at, next - at});
    at = next;
  }
  return out;
}

// Whether the early optimizer step takes a unit (when the step is on): its optimizer state off
// the device and its gradient on the host, where the host optimizer reads it as backward ends.
// The engine, the memory plan's second copies and the perf model follow this one rule.
inline bool early_step_takes(Tier optimizer, Tier grads) {
  return optimizer != Tier::kDevice && grads == Tier::kHost;
}

// The job the early optimizer's worker takes next (EarlyStepper::next_job; the perf model
// replays it): of `n` queued jobs, oldest first, the one whose NVMe state it read ahead
// (`read_ahead(i)`), else — of those whose gradient is complete (`ready(i)`) — the one whose unit
// the next forward needs first (`order(i)`, its place in the forward), else the oldest. The next
// forward waits for each unit's job in its own order, so this leaves the units it needs last to
// the end of the worker's backlog, and the worker stays busy while the forward runs. (Taken in
// the order the gradients come, the units stepped during backward are the ones the forward needs
// last: the worker idled through their forward and the next backward's first unit.)
template <class ReadAhead, class Ready, class Order>
std::size_t next_early_job(std::size_t n, ReadAhead read_ahead, Ready ready, Order order) {
  std::size_t best = n;
  for (std::size_t i = 0; i < n; ++i) {
    if (read_ahead(i)) return i;
    if (ready(i) && (best == n || order(i) < order(best))) best = i;
  }
  return best == n ? 0 : best;
}

struct UnitLayout {
  std::uint64_t numel = 0, padded = 0, shard = 0;  // elements; shard = padded / world
  // Full weights on the device for good, with no compute-weight shard of their own: stage < 3,
  // or at most stage3_param_persistence_threshold elements.
  bool persistent = false;
  // Never gathered on use: persistent, or (one rank) a device-tier shard, which is the whole
  // unit already.
  bool resident = false;
  // The compute-weight shard (placed by `params` over the non-persistent units only), the fp32
  // gradient shard (by `grads`) and the optimizer state (by `optimizer`), each over the units
  // in order by its first byte. `w` is kDevice for a persistent unit.
  Tier w = Tier::kDevice, g = Tier::kDevice, o = Tier::kDevice;
};

// Whether two nvme_path lists name the same directories, however spelled ("/nvme" and "/nvme/",
// a link to it): the engine keeps one swap store for them (two on one directory would share its
// rank<N>/, which the store refuses), and the plan rounds their files up as one.
bool same_dirs(const std::vector<std::string>& a, const std::vector<std::string>& b);

// The config key the gradients' NVMe directories came from (parse_engine_config: the optimizer's
// nvme_path when it is on NVMe, else the parameters'), to name in a store's errors.
inline const char* grad_nvme_path_key(const EngineConfig& c) {
  const bool optimizer =
      c.grad_nvme_paths == c.optimizer_nvme_paths && c.optimizer.nvme_fraction() > 1e-12;
  return optimizer || c.grad_nvme_paths != c.param_nvme_paths
             ? "zero_optimization.offload_optimizer.nvme_path"
             : "zero_optimization.offload_param.nvme_path";
}

// Refuses gradient shards on NVMe without a directory for them (EngineConfig::grad_nvme_paths).
std::vector<UnitLayout> layout_units(const EngineConfig& c, std::span<const std::uint64_t> numel,
                                     int world);

}  // namespace strata::detail
