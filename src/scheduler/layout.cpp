#include "scheduler/layout.h"

#include <algorithm>
#include <filesystem>

#include "strata/error.h"

namespace strata::detail {

std::uint64_t padded_numel(std::uint64_t numel, int world) {
  const std::uint64_t align = kShardAlign * std::uint64_t(world);
  return (numel + align - 1) / align * align;
}

std::uint64_t sub_group_elems(const EngineConfig& c) {
  return std::max<std::uint64_t>(kShardAlign, c.sub_group_size / kShardAlign * kShardAlign);
}

std::uint64_t state_stride(std::uint64_t n) {
  constexpr std::uint64_t kPeriod = std::uint64_t(64) << 20, kNear = kStateGapElems * 4;
  // Some stride of 1 to 6 arrays within kNear bytes of a nonzero multiple of kPeriod.
  const auto near = [](std::uint64_t stride_bytes) {
    for (std::uint64_t k = 1; k <= 6; ++k) {
      const std::uint64_t bytes = k * stride_bytes, r = bytes % kPeriod;
      if (bytes + kNear > kPeriod && (r < kNear || kPeriod - r < kNear)) return true;
    }
    return false;
  };
  std::uint64_t s = n;
  while (near(4 * s)) s += kStateGapElems;
  return s;
}

std::uint64_t state_gap_bytes(std::uint64_t shard, std::uint64_t sg, Tier tier) {
  if (tier == Tier::kHost) return 4 * (state_elems(shard) - 3 * shard);
  if (tier != Tier::kNvme) return 0;
  std::uint64_t bytes = 0;
  for (std::uint64_t g = 0; g < num_pieces(shard, sg); ++g) {
    const std::uint64_t n = piece(shard, sg, g).size;
    bytes += 4 * (state_elems(n) - 3 * n);
  }
  return bytes;
}

std::uint64_t bucket_share_elems(const EngineConfig& c, int world) {
  const std::uint64_t share = c.reduce_bucket_size / std::uint64_t(std::max(1, world));
  return std::max<std::uint64_t>(kShardAlign, share / kShardAlign * kShardAlign);
}

bool same_dirs(const std::vector<std::string>& a, const std::vector<std::string>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    std::error_code ec;
    if (a[i] != b[i] && !std::filesystem::equivalent(a[i], b[i], ec)) return false;
  }
  return true;
}

std::vector<UnitLayout> layout_units(const EngineConfig& c, std::span<const std::uint64_t> numel,
                                     int world) {
  STRATA_REQUIRE(world >= 1, "layout: world size {} must be at least 1", world);
  std::vector<UnitLayout> u(numel.size());
  double w_total = 0, g_total = 0, o_total = 0;
  for (std::size_t i = 0; i < u.size(); ++i) {
    u[i].numel = numel[i];
    u[i].padded = padded_numel(numel[i], world);
    u[i].shard = u[i].padded / std::uint64_t(world);
    u[i].persistent = c.stage < 3 || numel[i] <= c.param_persistence_threshold;
    if (!u[i].persistent) w_total += double(u[i].shard);
    g_total += double(u[i].shard);
    o_total += double(u[i].shard);
  }
  double w_pos = 0, g_pos = 0, o_pos = 0;
  for (UnitLayout& x : u) {
    if (!x.persistent) {
      x.w = c.params.tier_at(w_pos, w_total);
      w_pos += double(x.shard);
    }
    x.g = c.grads.tier_at(g_pos, g_total);
    g_pos += double(x.shard);
    STRATA_REQUIRE(x.g != Tier::kNvme || !c.grad_nvme_paths.empty(),
                   "gradient shards on NVMe need a directory: zero_optimization.offload_grads "
                   "\"nvme\" keeps them "
                   "under offload_optimizer.nvme_path (or offload_param.nvme_path when the "
                   "optimizer is not on NVMe); "
                   "set one");
    x.o = c.optimizer.tier_at(o_pos, o_total);
    o_pos += double(x.shard);
    x.resident = x.persistent || (world == 1 && x.w == Tier::kDevice);
  }
  return u;
}

}  // namespace strata::detail
