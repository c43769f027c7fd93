// The memory planner: the bytes one rank holds on each tier for a given config and model,
// computed before the first step so that a configuration that cannot fit is refused with the
// tier, the bytes missing and what to change — instead of an out-of-memory error mid-step.
//
// The plan is the engine's own bookkeeping, written down; the engine must allocate no byte
// that is not in a line here. The rules (W = world size, c = compute dtype size: 4 fp32,
// 2 bf16/fp16; a "unit" is one fetch unit, one per layer):
//   - Each unit's parameters are one flat buffer of numel elements padded up to a multiple of
//     W * 2048 (4 KiB of bf16 per shard, the smallest useful I/O), so shard = padded / W
//     elements on every rank and every shard is a whole number of 4 KiB pages.
//   - Sharded state, placed by its Placement in unit order (a unit is never split: its tier is
//     Placement::tier_at of its first byte; scheduler/layout.h, which the engine lays out by):
//       stage 3 compute-weight shard   shard * c        by `params`, over non-persistent units
//       fp32 gradient shard            shard * 4        by `grads`
//       fp32 master, Adam m and v      shard * 12       by `optimizer`
//     and off the device, the gaps after master, m and v that keep them (and the blocks beside
//     them) from lying a multiple of 64 MiB apart (layout.h's state_stride: 64 or 128 KiB each,
//     on the host a unit's block, on NVMe each sub-group's record; none where the sizes do not
//     call for them).
//   - Stage 3 on the device: a unit with numel <= stage3_param_persistence_threshold stays
//     gathered (padded * c) and has no compute-weight shard of its own. The others are gathered on
//     use: the live budget is max(largest non-persistent unit, min(stage3_max_live_parameters,
//     their sum)) * c, plus one more unit in flight for prefetch (largest non-persistent unit * c).
//     With one rank, a unit whose compute-weight shard is on the device is never gathered (the
//     shard is the whole unit): only offloaded units count here.
//   - Stages 1 and 2 keep every unit's full padded weights on the device (padded * c) and have
//     no separate compute-weight shard. Stage 1 is planned like stage 2 (a gradient shard).
//   - Unit gradients on the device: the model writes one unit's full fp32 gradient before it
//     is reduced, largest unit padded * 4, doubled with overlap_comm (one reduces while the
//     next fills). The reducer then works in buckets: R = min(reduce_bucket_size / W in whole
//     pages, largest shard) elements of every rank's shard at a time. With W > 1, the
//     reduce-scatter's output: the largest shard * 4, or, where (W + 1) * R is less (a unit of
//     many buckets, which is then reduce-scattered bucket by bucket), R * 4 and the bucket's
//     input gathered side by side, W * R * 4.
//   - Pinned host staging:
//       gradient D2H: 2 * R * 4 (double-buffered), when any gradient shard is on the host, or
//         the larger of that and S * 4 when the host optimizer has device gradients (it reads
//         them on the host, a sub-group at a time);
//       gradient NVMe staging: 2 * 2 * R * 4 when any gradient shard is on NVMe (two buckets in
//         flight, each its copy from the device and what its keys held, read back to add to);
//       gradient swap buffers: 2 * S * 4 in whole pages, the same (a sub-group's gradient read
//         ahead for the optimizer, one stepping);
//       parameter swap: offload_param.buffer_count whole shards read ahead, each the largest
//         shard * c in whole 4 KiB pages, when any compute weights live on NVMe;
//       optimizer swap: max(3, offload_optimizer.buffer_count) buffers (one read ahead, one
//         stepping, the rest written behind), each one sub-group's state: S * 12 in whole
//         pages, S = min(sub_group_size in whole pages, largest shard), when any optimizer
//         state lives on NVMe (the host optimizer steps a unit a sub-group at a time); with
//         gaps, the largest sub-group record;
//       new compute weights on their way from the optimizer to the device or NVMe: 2 * S * c,
//         when the optimizer state or the weights leave the device.
//   The engine waits for the oldest of each kind of staging before it takes one more.
//   - The early optimizer step (strata.overlap_optimizer; when the optimizer state leaves the
//     device and the gradients are on the host): each unit's AdamW runs while backward still
//     runs, into a second copy of its state, kept at step() only if the step needs no
//     clipping and no skip. It adds a second copy of the host-tier optimizer state (host) and
//     of the NVMe-tier state (NVMe), a second copy of host- and NVMe-tier compute weights, and
//     the new weights of device-resident units held in pinned memory until the unit switches
//     to them, at the end of step() or at its next fetch (shard * c each). Left unset, it is
//     turned off when the plan does not fit with it but does without (a note in the plan says
//     so).
//   - Activations: the model's estimate for one micro-batch, on the device.
// Capacities: the device's, strata.host_budget_bytes (else the caller's host capacity), and
// the free bytes under the NVMe paths. The planner never allocates; it only adds.
#include <unistd.h>

#include <algorithm>
#include <array>

#include "cpu/cpu_info.h"
#include "scheduler/schedule.h"
#include "strata/dtype.h"
#include "strata/engine_config.h"
#include "strata/error.h"
#include "strata/log.h"
#include "strata/nvme.h"

namespace strata {

namespace {

std::string human(std::uint64_t bytes) { return log::human_bytes(double(bytes)); }

std::string join_or(const std::vector<std::string>& items) {
  std::string out;
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (i > 0) out += i + 1 == items.size() ? ", or " : ", ";
    out += items[i];
  }
  return out;
}

// The plan under construction: its lines, and the sizes and tiers the later pieces read.
struct Builder {
  const EngineConfig& config;
  const PlanInputs& in;
  MemoryPlan plan;

  // The units (unit_sizes)
  std::uint64_t c = 0;  // the compute dtype's size
  std::vector<std::uint64_t> numel, shard;
  std::vector<detail::UnitLayout> layout;
  std::uint64_t total_padded = 0, total_shard = 0, largest_padded = 0, largest_shard = 0,
                largest_numel = 0;
  std::uint64_t persistent_padded = 0, np_sum = 0, np_largest = 0;  // np: gathered on use
  // The sharded state's bytes per tier, the live budget, the bucket share R and the sub-group S
  std::array<std::uint64_t, 3> param_tiers{}, grad_tiers{}, opt_tiers{};
  std::array<std::uint64_t, 3> opt_gaps{};  // after master, m and v (layout.h), by tier
  std::uint64_t live = 0, R = 0, S = 0;
  std::uint64_t sg = 0;  // a sub-group's elements as the engine cuts shards (layout.h)
  // The host staging (add_host_staging)
  bool host_optimizer = false;
  bool staging_r =
      false;  // the gradient D2H staging is two bucket shares (reduce_bucket_size sizes it)
  bool grads_nvme = false;
  std::uint64_t opt_swap_buffer = 0;
  int opt_buffers = 0;
  std::array<std::uint64_t, 3> o2{}, w2{};  // the early step's second copies, by tier
  std::uint64_t budget = 0;                 // the host budget before its rounding to pinned pieces

  Builder(const EngineConfig& cfg, const PlanInputs& inputs) : config(cfg), in(inputs) {}

  void add(std::string what, Tier tier, std::uint64_t bytes) {
    if (bytes == 0) return;
    plan.lines.push_back({std::move(what), tier, bytes});
  }
  // Places per-unit byte counts by `p` in unit order; returns the bytes per tier.
  std::array<std::uint64_t, 3> place(const std::string& what, const Placement& p,
                                     const std::vector<std::uint64_t>& unit_bytes) {
    std::uint64_t total = 0;
    for (auto b : unit_bytes) total += b;
    std::array<std::uint64_t, 3> per_tier{};
    std::uint64_t pos = 0;
    for (auto b : unit_bytes) {
      per_tier[static_cast<int>(p.tier_at(static_cast<double>(pos), static_cast<double>(total)))] +=
          b;
      pos += b;
    }
    for (Tier t : {Tier::kDevice, Tier::kHost, Tier::kNvme})
      add(what, t, per_tier[static_cast<int>(t)]);
    return per_tier;
  }
  std::vector<std::uint64_t> scaled(std::uint64_t k) const {
    std::vector<std::uint64_t> v;
    for (auto s : shard) v.push_back(s * k);
    return v;
  }

  void unit_sizes();
  void add_weights();
  void add_gradients_and_optimizer_state();
  void add_host_staging();
  void add_early_step();
  void add_swap_slack();
  void add_notes();
  void sum_and_capacities();
  // The device's capacity beyond its lines (0 when they pass it).
  std::uint64_t device_room() const {
    return plan.device_capacity > plan.device_bytes ? plan.device_capacity - plan.device_bytes : 0;
  }
  void device_problem();
  void host_problem();
  void nvme_problem();
  void host_ram();
};

// The units as the engine lays them out (layout.h), their shards and the sizes the lines use.
void Builder::unit_sizes() {
  c = dtype_size(config.compute_dtype);
  for (const UnitSize& u : in.units) numel.push_back(u.numel);
  layout = detail::layout_units(config, numel, in.world_size);
  for (const detail::UnitLayout& u : layout) {
    shard.push_back(u.shard);
    total_padded += u.padded;
    total_shard += u.shard;
    largest_padded = std::max(largest_padded, u.padded);
    largest_shard = std::max(largest_shard, u.shard);
    if (u.persistent) persistent_padded += u.padded;
    if (u.resident) continue;
    np_sum += u.padded;
    np_largest = std::max(np_largest, u.padded);
  }
  largest_numel = numel.empty() ? 0 : *std::max_element(numel.begin(), numel.end());
  sg = detail::sub_group_elems(config);
}

// The compute weights: stage 3's shards, persistent units and the gathered ones; below stage 3
// the full weights.
void Builder::add_weights() {
  const std::string cname(dtype_name(config.compute_dtype));
  if (config.stage == 3) {
    // Persistent units have no shard of their own (their gathered weights are the line below).
    for (const detail::UnitLayout& u : layout)
      if (!u.persistent) param_tiers[static_cast<int>(u.w)] += u.shard * c;
    for (Tier t : {Tier::kDevice, Tier::kHost, Tier::kNvme})
      add(fmt::format("compute weights ({} shard)", cname), t, param_tiers[static_cast<int>(t)]);
    add(fmt::format("persistent units (gathered, <= {} elements)",
                    config.param_persistence_threshold),
        Tier::kDevice, persistent_padded * c);
    live = std::max(np_largest, std::min(config.max_live_parameters, np_sum)) * c;
    add("gathered units (live budget)", Tier::kDevice, live);
    add("prefetch (one unit in flight)", Tier::kDevice, np_largest * c);
  } else {
    add(fmt::format("full weights ({}, replicated at stage {})", cname, config.stage),
        Tier::kDevice, total_padded * c);
  }
}

// The gradient shards and the optimizer state, placed; the unit gradients the model writes, the
// reducer's buffers and the activations on the device.
void Builder::add_gradients_and_optimizer_state() {
  grad_tiers = place("gradient shard (fp32)", config.grads, scaled(4));
  opt_tiers = place("optimizer state (fp32 master, m, v)", config.optimizer, scaled(12));
  for (const detail::UnitLayout& u : layout)
    opt_gaps[static_cast<int>(u.o)] += detail::state_gap_bytes(u.shard, sg, u.o);
  for (Tier t : {Tier::kHost, Tier::kNvme})
    add("optimizer state: gaps after master, m and v (64 or 128 KiB each)", t,
        opt_gaps[static_cast<int>(t)]);
  add(config.overlap_comm ? "unit gradients (2 x largest unit, fp32, for overlap_comm)"
                          : "unit gradient (largest unit, fp32)",
      Tier::kDevice, largest_padded * 4 * detail::unit_grads_alive(config));
  // The reducer works a bucket (reduce_bucket_size elements: a share of every rank's shard)
  // at a time. With more than one rank, the reduce-scatter's output: a shard, or, where a unit
  // is large enough that going bucket by bucket takes less (layout.h), one bucket's share and
  // the bucket's input gathered side by side.
  R = std::min(detail::bucket_share_elems(config, in.world_size), largest_shard);
  if (in.world_size > 1) {
    if (detail::bucketed_reduce(largest_shard, R, in.world_size)) {
      add(fmt::format("reduce-scatter output ({} elements, fp32)", R), Tier::kDevice, R * 4);
      add(fmt::format("reduce-scatter bucket ({} x {} elements, fp32)", in.world_size, R),
          Tier::kDevice, std::uint64_t(in.world_size) * R * 4);
    } else {
      add(fmt::format("reduce-scatter output ({} elements, fp32)", largest_shard), Tier::kDevice,
          largest_shard * 4);
    }
  }
  add("activations (one micro-batch)", Tier::kDevice, in.activation_bytes);
}

// Pinned host staging: gradients to the host and to NVMe, the swap buffers, the new weights.
void Builder::add_host_staging() {
  host_optimizer = opt_tiers[0] < total_shard * 12;
  // The optimizer's unit of work: a sub-group, or the largest shard when that is smaller.
  S = std::min(sg, largest_shard);
  // (Not for NVMe gradients: their staging is its own line below.)
  if (grad_tiers[1] > 0 || (host_optimizer && grad_tiers[0] > 0)) {
    // reduce_grad's 2 bucket shares, or (not at the same time) step()'s one sub-group of a
    // device gradient staged for the host optimizer
    const std::uint64_t buckets = detail::kGradBucketsInFlight * R;
    const std::uint64_t E = std::max(buckets, host_optimizer && grad_tiers[0] > 0 ? S : 0);
    staging_r = E == buckets;
    add(staging_r ? fmt::format("gradient D2H staging ({} x {} elements, fp32)",
                                detail::kGradBucketsInFlight, R)
                  : fmt::format("gradient D2H staging ({} elements: a sub-group, fp32)", S),
        Tier::kHost, E * 4);
  }
  grads_nvme = grad_tiers[static_cast<int>(Tier::kNvme)] > 0;
  if (grads_nvme) {
    add(fmt::format("gradient NVMe staging ({} x 2 x {} elements, fp32: bucket, read back)",
                    detail::kGradBucketsInFlight, R),
        Tier::kHost, detail::kGradBucketsInFlight * 2 * R * 4);
    add(fmt::format("gradient swap buffers (2 x {} elements, fp32: read ahead, step)", S),
        Tier::kHost, 2 * SwapStore::padded_bytes(S * 4));
  }
  if (param_tiers[static_cast<int>(Tier::kNvme)] > 0) {
    add(fmt::format("parameter swap buffers ({} x largest shard, read ahead)",
                    detail::weight_reads_in_flight(config)),
        Tier::kHost,
        detail::weight_reads_in_flight(config) * SwapStore::padded_bytes(largest_shard * c));
  }
  // One sub-group's record: S * 12, or the largest with gaps (a unit's last sub-group can be
  // shorter and have them where S has none).
  std::uint64_t record = detail::state_elems(S);
  for (const detail::UnitLayout& u : layout) {
    record = std::max(record, detail::state_elems(std::min(sg, u.shard)));
    if (u.shard > sg && u.shard % sg != 0)
      record = std::max(record, detail::state_elems(u.shard % sg));
  }
  opt_swap_buffer = SwapStore::padded_bytes(record * 4);
  opt_buffers = int(detail::state_buffers(config));
  if (opt_tiers[static_cast<int>(Tier::kNvme)] > 0) {
    add(fmt::format(
            "optimizer swap buffers ({} x {} elements' state: read ahead, step, write behind)",
            opt_buffers, S),
        Tier::kHost, static_cast<std::uint64_t>(opt_buffers) * opt_swap_buffer);
  }
  if (host_optimizer || param_tiers[static_cast<int>(Tier::kNvme)] > 0) {
    add(fmt::format("new compute-weight staging ({} x {} elements)", detail::kWeightStagingInFlight,
                    S),
        Tier::kHost, detail::kWeightStagingInFlight * S * c);
  }
}

// The early optimizer step's second copies of the state and weights it takes.
void Builder::add_early_step() {
  plan.early_optimizer_step =
      config.overlap_optimizer.value_or(true) && host_optimizer && grad_tiers[1] > 0;
  if (!plan.early_optimizer_step) return;
  // The units the early step takes have second copies; the others are stepped in step().
  std::uint64_t new_device_w = 0;
  for (const detail::UnitLayout& u : layout) {
    if (!detail::early_step_takes(u.o, u.g)) continue;
    o2[static_cast<int>(u.o)] += u.shard * 12 + detail::state_gap_bytes(u.shard, sg, u.o);
    // Where its new weights go (schedule.h): a second copy on their tier, or held for the device.
    if (detail::weights_out(u.resident, u.w) == detail::WeightsOut::kDevice)
      new_device_w += u.shard * c;
    else
      w2[static_cast<int>(u.w)] += u.shard * c;
  }
  const int H = static_cast<int>(Tier::kHost), N = static_cast<int>(Tier::kNvme);
  add("early optimizer step: 2nd copy of host optimizer state", Tier::kHost, o2[H]);
  add("early optimizer step: 2nd copy of NVMe optimizer state", Tier::kNvme, o2[N]);
  add("early optimizer step: 2nd copy of host compute weights", Tier::kHost, w2[H]);
  add("early optimizer step: 2nd copy of NVMe compute weights", Tier::kNvme, w2[N]);
  add("early optimizer step: new device weights until switched", Tier::kHost, new_device_w);
}

// The swap store grows its files a whole aio.block_size stripe at a time; the parameters,
// the optimizer state and the gradients each have a store, or share one where they share
// the paths (Engine::finalize).
void Builder::add_swap_slack() {
  const int N = static_cast<int>(Tier::kNvme);
  std::vector<std::pair<std::vector<std::string>, std::uint64_t>> stores;
  const auto put = [&](const std::vector<std::string>& paths, std::uint64_t bytes) {
    if (bytes == 0) return;
    for (auto& [p, n] : stores)
      if (detail::same_dirs(p, paths)) {
        n += bytes;
        return;
      }
    stores.push_back({paths, bytes});
  };
  put(config.param_nvme_paths, param_tiers[N] + w2[N]);
  put(config.optimizer_nvme_paths, opt_tiers[N] + opt_gaps[N] + o2[N]);
  put(config.grad_nvme_paths, grad_tiers[N]);
  const std::uint64_t stripe = std::max<std::uint64_t>(config.aio.block_size, 1);
  std::uint64_t slack = 0;
  for (const auto& [p, bytes] : stores) slack += (bytes + stripe - 1) / stripe * stripe - bytes;
  add(fmt::format("swap files: rounded up to whole stripes (aio.block_size {})", human(stripe)),
      Tier::kNvme, slack);
}

// Values the engine uses otherwise than written, said (the table's lines use them already).
void Builder::add_notes() {
  // A reduce_bucket_size below the largest unit, the reason a user sets it (less device memory),
  // bounds the reducer's buffers but not the unit's gradient the model writes: said.
  // (Against the unit's own elements: the padding to whole pages per rank is strata's.)
  if (config.reduce_bucket_size_given && config.reduce_bucket_size < largest_numel) {
    plan.notes.push_back(fmt::format(
        "zero_optimization.reduce_bucket_size {} is below the largest unit ({} elements): "
        "gradients are accumulated "
        "in buckets of {} elements a rank (whole pages){}, but the model writes a unit's whole "
        "fp32 gradient before it "
        "is reduced ({}{})",
        config.reduce_bucket_size, largest_numel, detail::bucket_share_elems(config, in.world_size),
        in.world_size == 1 ? ""
        : detail::bucketed_reduce(largest_shard, R, in.world_size)
            ? " and the largest reduce-scattered bucket by bucket"
            : " (each still reduce-scattered whole: bucket by bucket only where (world + 1) shares "
              "are less than a "
              "shard)",
        human(largest_padded * 4), config.overlap_comm ? ", two with overlap_comm" : ""));
  }
  if (config.sub_group_size_given && host_optimizer && sg != config.sub_group_size)
    plan.notes.push_back(
        fmt::format("zero_optimization.sub_group_size {} is used as {} elements (whole {}-element "
                    "pages, at least one)",
                    config.sub_group_size, sg, detail::kShardAlign));
  if (opt_tiers[static_cast<int>(Tier::kNvme)] > 0 && config.optimizer_buffer_count < opt_buffers)
    plan.notes.push_back(
        fmt::format("offload_optimizer.buffer_count {}: {} swap buffers are used (one read ahead, "
                    "one stepping, one written behind)",
                    config.optimizer_buffer_count, opt_buffers));
  if (config.stage == 3 && np_largest > 0 && config.max_live_parameters < np_largest)
    plan.notes.push_back(
        fmt::format("stage3_max_live_parameters {} is below the largest gathered unit ({} "
                    "elements, padded): the live budget is raised to that unit",
                    config.max_live_parameters, np_largest));
}

// The pinned pool commits memory in whole 2 MiB pieces: a budget is usable to its last one.
constexpr std::uint64_t kPinnedPiece = std::uint64_t(2) << 20;

// Each tier's total, and its capacity.
void Builder::sum_and_capacities() {
  for (const PlanLine& l : plan.lines) {
    (l.tier == Tier::kDevice ? plan.device_bytes
     : l.tier == Tier::kHost ? plan.host_bytes
                             : plan.nvme_bytes) += l.bytes;
  }
  plan.device_capacity = in.device_capacity;
  budget = config.host_budget_bytes > 0 ? config.host_budget_bytes : in.host_capacity;
  plan.host_capacity = budget == UINT64_MAX ? budget : budget / kPinnedPiece * kPinnedPiece;

  plan.nvme_capacity = in.nvme_capacity;
}

std::string shortfall(const char* tier, std::uint64_t need, std::uint64_t have) {
  return fmt::format("{}: needs {}, has {} ({} = {} bytes missing)", tier, human(need), human(have),
                     human(need - have), need - have);
}

// The device over its capacity: only what would actually shrink this plan's device bytes.
void Builder::device_problem() {
  if (plan.device_bytes <= plan.device_capacity) return;
  std::vector<std::string> fix;
  if (opt_tiers[0] > 0)
    fix.push_back("offload the optimizer state (offload_optimizer.device \"cpu\" or \"nvme\")");
  // A piece already split between device and host: its ratio is what to raise.
  if (grad_tiers[0] > 0 && config.grads.host_fraction > 0)
    fix.push_back(fmt::format(
        "raise zero_optimization.offload_grads_ratio (now {}: the share of the gradient "
        "shards on the host)",
        config.grads.host_fraction));
  else if (grad_tiers[0] > 0)
    fix.push_back("keep gradient shards on the host (zero_optimization.offload_grads \"cpu\")");
  if (config.stage < 3)
    fix.push_back("use zero_optimization.stage 3 (only the layers in use are gathered)");
  if (param_tiers[0] > 0 && config.params.host_fraction > 0)
    fix.push_back(fmt::format(
        "raise offload_param.ratio (now {}: the share of the weight shards on the host), or "
        "move them to NVMe (offload_param.device \"nvme\")",
        config.params.host_fraction));
  else if (param_tiers[0] > 0)
    fix.push_back("offload the parameters (offload_param.device \"cpu\" or \"nvme\")");
  if (config.stage == 3 && live > np_largest * c) {
    fix.push_back(
        fmt::format("lower stage3_max_live_parameters (now {}; the largest unit is {} elements)",
                    config.max_live_parameters, np_largest));
  }
  if (config.stage == 3 && persistent_padded > 0)
    fix.push_back("lower stage3_param_persistence_threshold");
  if (config.overlap_comm)
    fix.push_back("set overlap_comm false (one unit gradient buffer instead of two)");
  if (in.activation_bytes > 0) {
    fix.push_back(fmt::format("a smaller train_micro_batch_size_per_gpu (activations take {})",
                              human(in.activation_bytes)));
  }
  // More ranks shrink only the shards the device holds (with none there, a plan for more ranks
  // only adds the reduce-scatter's output).
  if (opt_tiers[0] > 0 || (config.stage >= 2 && grad_tiers[0] > 0) ||
      (config.stage == 3 && param_tiers[0] > 0))
    fix.push_back("more data-parallel ranks (each holds 1/N of the shards)");
  plan.problems.push_back(shortfall("device", plan.device_bytes, plan.device_capacity) + ": " +
                          join_or(fix));
}

// Pinned host memory over its budget: what would shrink the host lines.
void Builder::host_problem() {
  if (plan.host_bytes <= plan.host_capacity) return;
  std::vector<std::string> fix;
  if (opt_tiers[1] > 0 && config.stage == 3)
    fix.push_back(
        "move the optimizer state to NVMe (offload_optimizer.device \"nvme\", a lower "
        "offload_optimizer.host_fraction)");
  else if (opt_tiers[1] > 0)  // (NVMe optimizer state needs stage 3)
    fix.push_back(
        "keep part of the optimizer state on the device (offload_optimizer.ratio below 1: the "
        "share on the "
        "host), or zero_optimization.stage 3 to move it to NVMe");
  if (param_tiers[1] > 0)
    fix.push_back(
        "move the parameters to NVMe (offload_param.device \"nvme\", a lower "
        "offload_param.host_fraction)");
  if (opt_tiers[2] > 0 && config.optimizer_buffer_count > 3) {
    fix.push_back(
        fmt::format("lower offload_optimizer.buffer_count (now {}; at least 3 are used, each {})",
                    config.optimizer_buffer_count, human(opt_swap_buffer)));
  }
  if (opt_tiers[2] > 0 && S > detail::kShardAlign) {
    fix.push_back(fmt::format(
        "a smaller zero_optimization.sub_group_size (the optimizer's swap buffers hold {} "
        "elements' state each, {})",
        S, human(opt_swap_buffer)));
  } else if (host_optimizer && S > detail::kShardAlign) {
    fix.push_back(fmt::format(
        "a smaller zero_optimization.sub_group_size (the new weights are staged {} elements "
        "at a time)",
        S));
  }
  if ((staging_r || grads_nvme) && R > detail::kShardAlign) {
    fix.push_back(fmt::format(
        "a smaller zero_optimization.reduce_bucket_size (the gradient {} staging holds {} x "
        "{} elements, {})",
        grads_nvme ? "NVMe" : "D2H", grads_nvme ? 4 : 2, R, human((grads_nvme ? 4 : 2) * R * 4)));
  }
  if (param_tiers[2] > 0 && config.param_buffer_count > 1) {
    fix.push_back(fmt::format("lower offload_param.buffer_count (now {}; each {})",
                              config.param_buffer_count,
                              human(SwapStore::padded_bytes(largest_shard * c))));
  }
  if (grad_tiers[1] > 0 && config.grads.nvme_fraction() > 1e-12)
    fix.push_back(
        fmt::format("lower zero_optimization.offload_grads_host_fraction (now {}: the share of the "
                    "gradient shards kept on the host beside NVMe)",
                    config.grads.host_fraction));
  // The gradients moved to the device where it has room for them (a device already full, or too
  // small for them, was offered them).
  else if (grad_tiers[1] > 0 && config.grads.device_fraction > 0 && device_room() > 0)
    fix.push_back(fmt::format(
        "lower zero_optimization.offload_grads_ratio (now {}: the share of the gradient "
        "shards on the host; the device has {} free)",
        config.grads.host_fraction, human(device_room())));
  else if (grad_tiers[1] > 0 && config.grads.device_fraction <= 0 && device_room() >= grad_tiers[1])
    fix.push_back("keep gradient shards on the device (zero_optimization.offload_grads \"none\")");
  if (grad_tiers[1] > 0 && config.grads.nvme_fraction() <= 1e-12 && config.stage == 3)
    fix.push_back(
        "move the gradient shards to NVMe (zero_optimization.offload_grads \"nvme\": beside the "
        "optimizer state or the parameters on NVMe)");
  fix.push_back(fmt::format(
      "raise strata.host_budget_bytes (now {}{})", budget,
      in.ranks_on_node > 1
          ? fmt::format("; the default gives each of the {} ranks on this node 1/{} of 80% of RAM",
                        in.ranks_on_node, in.ranks_on_node)
          : std::string()));
  std::string problem = shortfall("host", plan.host_bytes, plan.host_capacity);
  if (plan.host_capacity != budget)  // "(" ... "bytes missing)": say where "has" comes from first
    problem.insert(
        problem.find(" (") + 2,
        fmt::format("the budget of {} bytes in whole 2 MiB pieces, as the pinned pool commits it; ",
                    budget));
  plan.problems.push_back(problem + ": " + join_or(fix));
}

void Builder::nvme_problem() {
  if (plan.nvme_bytes <= plan.nvme_capacity) return;
  plan.problems.push_back(
      shortfall("nvme", plan.nvme_bytes, plan.nvme_capacity) +
      (in.ranks_on_node > 1
           ? fmt::format(
                 " (this rank's share: the {} ranks on this node split each drive's free space)",
                 in.ranks_on_node)
           : std::string()) +
      ": free space under the nvme_path directories, add nvme_path directories on other "
      "drives" +
      (plan.host_bytes < plan.host_capacity
           ? fmt::format(", or keep more in host memory (offload_*.host_fraction; the host has {} "
                         "free)",
                         human(plan.host_capacity - plan.host_bytes))
           : std::string()));
}

// Host RAM: the rank's resident memory in all, load, step and save: the process before the
// engine, the pinned lines, the emulated device's memory, and the larger pageable buffer of
// the phases (finalize's initial weights a sub-group at a time, a save's one gathered unit).
void Builder::host_ram() {
  const auto ram = [&](std::string what, std::uint64_t bytes) {
    plan.ram_lines.push_back({std::move(what), Tier::kHost, bytes});
    plan.ram_bytes += bytes;
  };
  ram("the process before the engine (libraries, model, data: measured)", in.ram_base_bytes);
  ram("pinned host memory (the host lines above)", plan.host_bytes);
  if (in.device_in_ram)
    ram("the CPU-emulated device's memory (the device lines above)", plan.device_bytes);
  ram(fmt::format(
          "initial weights ({} elements at a time) or a save (one unit, {} elements), the larger",
          S, largest_numel),
      std::max(S, largest_numel) * 4);
  if (config.model_host_ram_bytes > 0) ram(config.model_host_ram_what, config.model_host_ram_bytes);
  plan.ram_capacity = in.ram_capacity;
  if (in.ram_capacity == 0 || plan.ram_bytes <= in.ram_capacity) return;
  std::vector<std::string> fix;
  if (opt_tiers[1] > 0 && config.stage == 3)
    fix.push_back("move the optimizer state to NVMe (offload_optimizer.device \"nvme\")");
  if (grad_tiers[1] > 0 && config.stage == 3)
    fix.push_back("move the gradient shards to NVMe (zero_optimization.offload_grads \"nvme\")");
  if (param_tiers[1] > 0)
    fix.push_back("move the parameters to NVMe (offload_param.device \"nvme\")");
  if (config.model_host_ram_bytes > 0)
    fix.push_back(
        "--checkpoint-activations instead of --checkpoint-on-host (the layer checkpoints on the "
        "device)");
  if (in.device_in_ram)
    fix.push_back(
        "a smaller memory cap for the CPU-emulated device (--device-mem-gb: its memory is host "
        "RAM)");
  if (S > detail::kShardAlign && S * 4 >= largest_numel * 4)
    fix.push_back("a smaller zero_optimization.sub_group_size");
  if (in.ranks_on_node > 1)
    fix.push_back(fmt::format("fewer ranks on this node (now {})", in.ranks_on_node));
  fix.push_back("a machine with more memory");
  plan.problems.push_back(
      fmt::format(
          "host RAM: needs {}, has {} ({} = {} bytes missing: this rank's share of what the node "
          "has "
          "available{}, with what the process holds already)",
          human(plan.ram_bytes), human(in.ram_capacity), human(plan.ram_bytes - in.ram_capacity),
          plan.ram_bytes - in.ram_capacity,
          in.ranks_on_node > 1 ? fmt::format(", split among its {} ranks", in.ranks_on_node) : "") +
      ": " + join_or(fix));
}

}  // namespace

MemoryPlan plan_memory(const EngineConfig& config, const PlanInputs& in) {
  STRATA_REQUIRE(in.world_size >= 1, "plan_memory: world_size = {}: must be at least 1",
                 in.world_size);
  STRATA_REQUIRE(config.stage >= 1 && config.stage <= 3, "plan_memory: stage {}: must be 1, 2 or 3",
                 config.stage);
  Builder b(config, in);
  b.unit_sizes();
  b.add_weights();
  b.add_gradients_and_optimizer_state();
  b.add_host_staging();
  b.add_early_step();
  b.add_swap_slack();
  b.add_notes();
  b.sum_and_capacities();
  b.device_problem();
  b.host_problem();
  b.nvme_problem();
  b.host_ram();
  MemoryPlan& plan = b.plan;
  plan.fits = plan.problems.empty();
  if (!plan.fits && plan.early_optimizer_step) {
    if (!config.overlap_optimizer.has_value()) {  // left to the planner: off, said aloud
      EngineConfig off = config;
      off.overlap_optimizer = false;
      MemoryPlan without = plan_memory(off, in);
      if (without.fits) {
        const bool host = plan.host_bytes > plan.host_capacity;
        without.notes.push_back(fmt::format(
            "strata.overlap_optimizer is off (the host optimizer waits for the end of backward): "
            "with its second copy of the state the {} would need {} of {}; {} to turn it on",
            host ? "host" : "NVMe", human(host ? plan.host_bytes : plan.nvme_bytes),
            human(host ? plan.host_capacity : plan.nvme_capacity),
            host ? fmt::format("set strata.host_budget_bytes to {} or more",
                               (plan.host_bytes + kPinnedPiece - 1) / kPinnedPiece * kPinnedPiece)
                 : std::string("free NVMe space")));
      }
      return without;
    }
    for (std::string& p : plan.problems)
      p += "; or set strata.overlap_optimizer false (no second copy of the optimizer state)";
  }
  return plan;
}

void set_host_ram_inputs(PlanInputs& in, const Device& device, int ranks_on_node) {
  in.ram_base_bytes = cpu::process_rss_bytes();
  const std::uint64_t avail = cpu::ram_available_bytes();
  in.ram_capacity =
      avail == 0 ? 0 : avail / std::uint64_t(std::max(1, ranks_on_node)) + in.ram_base_bytes;
  in.device_in_ram = device.kind() == DeviceKind::kCpu;
}

std::uint64_t default_host_budget(int ranks_on_node) {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  const std::uint64_t all = pages > 0 && page > 0
                                ? std::uint64_t(double(pages) * double(page) * 0.8)
                                : std::uint64_t(4) << 30;
  const std::uint64_t piece = std::uint64_t(2) << 20;  // the pinned pool commits whole 2 MiB pieces
  return all / std::uint64_t(std::max(1, ranks_on_node)) / piece * piece;
}

std::uint64_t gib_to_bytes(std::string_view flag, double gib) {
  constexpr double kMostGib = 8589934592.0;  // 2^33 GiB = 2^63 bytes
  STRATA_REQUIRE(!std::isnan(gib), "{} nan: give the memory in GiB, e.g. 80", flag);
  STRATA_REQUIRE(gib <= kMostGib,
                 "{} {}: more bytes than a 64-bit count holds (at most {:.0f} GiB, 8 EiB); give "
                 "the memory in GiB, e.g. 80",
                 flag, gib, kMostGib);
  return gib > 0 ? std::uint64_t(gib * double(1ull << 30)) : 0;
}

std::uint64_t nvme_capacity(const EngineConfig& config, int rank, int ranks_on_node,
                            int world_size) {
  const bool params = config.stage == 3 && config.params.nvme_fraction() > 0;
  const bool optimizer = config.optimizer.nvme_fraction() > 0;
  const bool grads = config.grads.nvme_fraction() > 0 && !config.grad_nvme_paths.empty();
  if (!params && !optimizer && !grads) return UINT64_MAX;
  std::vector<std::string> paths;
  const auto use = [&](const std::vector<std::string>& list, const char* key) {
    for (const std::string& p : list) {
      SwapStore::free_bytes({p}, rank, key);  // names the key of a missing directory
      if (std::find(paths.begin(), paths.end(), p) == paths.end()) paths.push_back(p);
    }
  };
  if (params) use(config.param_nvme_paths, "zero_optimization.offload_param.nvme_path");
  if (optimizer) use(config.optimizer_nvme_paths, "zero_optimization.offload_optimizer.nvme_path");
  if (grads) use(config.grad_nvme_paths, detail::grad_nvme_path_key(config));
  return SwapStore::free_bytes(paths, rank, "nvme_path", std::max(1, ranks_on_node), world_size);
}

std::string MemoryPlan::table() const {
  std::size_t width = 40;  // the "what" column: as wide as its longest line
  for (const PlanLine& l : lines) width = std::max(width, l.what.size());
  for (const PlanLine& l : ram_lines) width = std::max(width, l.what.size());
  std::string out =
      fmt::format("{:<7} {:<{}} {:>16} {:>12}\n", "tier", "what", width, "bytes", "size");
  const std::array<std::pair<Tier, std::pair<std::uint64_t, std::uint64_t>>, 3> tiers = {{
      {Tier::kDevice, {device_bytes, device_capacity}},
      {Tier::kHost, {host_bytes, host_capacity}},
      {Tier::kNvme, {nvme_bytes, nvme_capacity}},
  }};
  for (const auto& [tier, use] : tiers) {
    for (const PlanLine& l : lines) {
      if (l.tier == tier)
        out += fmt::format("{:<7} {:<{}} {:>16} {:>12}\n", tier_name(tier), l.what, width, l.bytes,
                           human(l.bytes));
    }
    const auto [bytes, cap] = use;
    if (cap == UINT64_MAX) {  // no NVMe path in use: nothing to check against
      out += fmt::format("{:<7} {:<{}} {:>16} {:>12}\n", tier_name(tier), "total", width, bytes,
                         human(bytes));
      continue;
    }
    out += fmt::format("{:<7} {:<{}} {:>16} {:>12}  of {} ({} bytes): {}\n", tier_name(tier),
                       "total", width, bytes, human(bytes), human(cap), cap,
                       bytes <= cap ? "ok" : fmt::format("OVER by {}", human(bytes - cap)));
  }
  if (ram_capacity > 0 || !ram_lines.empty()) {
    for (const PlanLine& l : ram_lines)
      out += fmt::format("{:<7} {:<{}} {:>16} {:>12}\n", "ram", l.what, width, l.bytes,
                         human(l.bytes));
    if (ram_capacity == 0)
      out += fmt::format("{:<7} {:<{}} {:>16} {:>12}\n", "ram", "total", width, ram_bytes,
                         human(ram_bytes));
    else
      out += fmt::format("{:<7} {:<{}} {:>16} {:>12}  of {} ({} bytes): {}\n", "ram", "total",
                         width, ram_bytes, human(ram_bytes), human(ram_capacity), ram_capacity,
                         ram_bytes <= ram_capacity
                             ? "ok"
                             : fmt::format("OVER by {}", human(ram_bytes - ram_capacity)));
  }
  out += fits ? "verdict: fits\n" : "verdict: does not fit\n";
  for (const std::string& n : notes) out += "  note: " + n + "\n";
  for (const std::string& p : problems) out += "  " + p + "\n";
  return out;
}

}  // namespace strata
