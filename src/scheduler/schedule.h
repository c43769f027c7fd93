// What runs where in a step: the path each piece of a unit's data takes, given where the layout
// (layout.h) put it, and how far each pipeline runs ahead of what waits for it. The engine takes
// these paths (param_coordinator.cpp, grad_reduce.cpp, optimizer_step.cpp, early_step.cpp), the
// perf model replays them (perf_model.cpp) and the planner counts their buffers (planner.cpp);
// tests/conformance_test.cpp checks, placement by placement, that the engine's streams and the
// model's replay carry the same transfers.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "scheduler/layout.h"

namespace strata::detail {

// A fetch: how a gathered unit's compute-weight shard reaches its place in the gathered buffer,
// on the fetch stream (an all-gather across the ranks follows).
enum class FetchPath {
  kDeviceCopy,  // a device-tier shard, copied on the device
  kUpload,      // a host-tier shard over the link (after the last step's write-back of it)
  kNvmeUpload,  // read from NVMe into pinned staging (param_buffer_count at once), then over the
                // link
};
inline FetchPath fetch_path(Tier w) {
  return w == Tier::kDevice ? FetchPath::kDeviceCopy
         : w == Tier::kHost ? FetchPath::kUpload
                            : FetchPath::kNvmeUpload;
}

// One bucket of a unit's reduced gradient, on the comm stream.
enum class GradPath {
  kDeviceAdd,     // added into the device-tier accumulator
  kNvme,          // to the host, added to what its keys hold (read back, after the step's first),
                  // its squares summed, written to NVMe behind (two buckets in flight)
  kStraightCopy,  // the step's first gradient of a host-tier unit: copied into the accumulator
  kStagedAdd,     // a later one: copied into pinned staging (two at once), added by the host
};
inline GradPath grad_path(Tier g, bool first_of_step) {
  if (g == Tier::kDevice) return GradPath::kDeviceAdd;
  if (g == Tier::kNvme) return GradPath::kNvme;
  return first_of_step ? GradPath::kStraightCopy : GradPath::kStagedAdd;
}

// Whether the device sums a host-tier gradient's part of the global norm beside its copy (and
// the 4 bytes go back with it), so the host makes no pass over it (strata.device_grad_norm): the
// step's only gradient of the unit, reduced whole (not bucket by bucket).
inline bool device_norm_takes(const EngineConfig& c, Tier g, bool first_of_step,
                              bool only_gradient_of_step, bool bucketed) {
  return g == Tier::kHost && first_of_step && only_gradient_of_step &&
         c.device_grad_norm.value_or(true) && !bucketed;
}

// The host optimizer's sub-groups that are read from NVMe one ahead of the one it steps: its
// state there, or (state on the host) its gradient there. (A device optimizer reads an NVMe
// gradient a sub-group at a time, waiting for each.)
inline bool reads_ahead_from_nvme(Tier optimizer, Tier grads) {
  return optimizer == Tier::kNvme || (grads == Tier::kNvme && optimizer == Tier::kHost);
}

// Where a unit's new compute weights go after its update.
enum class WeightsOut {
  kDevice,  // into the gathered (resident) weights or the device-tier shard: from the host
            // optimizer over the link, staged (two sub-groups at once)
  kHost,    // the host-tier shard: written in place by the host optimizer; from a device
            // optimizer, copied back on the write-back stream, which the next fetch waits for
  kNvme,    // the NVMe-tier shard: staged and written behind, a sub-group at a time
};
inline WeightsOut weights_out(bool resident, Tier w) {
  if (resident || w == Tier::kDevice) return WeightsOut::kDevice;
  return w == Tier::kHost ? WeightsOut::kHost : WeightsOut::kNvme;
}

// ---- When a unit is fetched ahead, and which one a fetch releases ----

// Prefetch takes the next unit in fetch order (padded elements) while the units already fetched
// ahead and it fit stage3_prefetch_bucket_size (0: no prefetch) and the live units and it stay
// within stage3_max_live_parameters; it stops at the first that does not.
inline bool prefetch_fits(const EngineConfig& c, std::uint64_t ahead, std::uint64_t live,
                          std::uint64_t padded) {
  return ahead + padded <= std::max<std::uint64_t>(c.prefetch_bucket_size, 1) &&
         live + padded <= c.max_live_parameters;
}
// A fetch of `need` elements first releases live units while they and it exceed
// stage3_max_live_parameters, ...
inline bool over_live_budget(const EngineConfig& c, std::uint64_t live, std::uint64_t need) {
  return live + need > c.max_live_parameters;
}
// ... each time the releasable unit (gathered, not resident, not in use) whose next use is
// furthest (Belady's rule; the first of a tie). Of units 0..n-1; n when none is releasable.
template <class Releasable, class NextUse>
std::size_t release_victim(std::size_t n, Releasable releasable, NextUse next_use) {
  std::size_t victim = n, furthest = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (!releasable(i)) continue;
    const std::size_t nu = next_use(i);
    if (victim == n || nu > furthest) {
      victim = i;
      furthest = nu;
    }
  }
  return victim;
}

// ---- How far each pipeline runs ahead: the host waits for the oldest in flight beyond these ----
// (The planner sizes the pinned buffers they hold by the same numbers.)

// Gradient buckets on their way to the host: GradPath::kStagedAdd's pinned staging, and
// GradPath::kNvme's buckets (staged, read back, written behind).
inline constexpr std::size_t kGradBucketsInFlight = 2;
// New compute weights staged in pinned memory from the host optimizer: to the device
// (WeightsOut::kDevice) or written behind to NVMe (WeightsOut::kNvme).
inline constexpr std::size_t kWeightStagingInFlight = 2;
// NVMe-tier weights read ahead for fetches (FetchPath::kNvmeUpload): offload_param.buffer_count.
inline std::size_t weight_reads_in_flight(const EngineConfig& c) {
  return std::size_t(std::max(1, c.param_buffer_count));
}
// The host optimizer's NVMe state buffers: one sub-group read ahead, one stepping, and the rest of
// offload_optimizer.buffer_count (at least one) written behind.
inline std::size_t state_writes_in_flight(const EngineConfig& c) {
  return std::size_t(std::max(1, c.optimizer_buffer_count - 2));
}
inline std::size_t state_buffers(const EngineConfig& c) { return 2 + state_writes_in_flight(c); }
// Unit gradients on the device: the one a backward writes and, with overlap_comm, the last unit's,
// its reduce still queued (Engine::grad_buffer waits for the oldest reduce beyond these).
inline std::size_t unit_grads_alive(const EngineConfig& c) { return c.overlap_comm ? 2 : 1; }

}  // namespace strata::detail
