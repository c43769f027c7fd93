// strata-prof's step-time model and search (include/strata/perf_model.h), and the strata-prof
// command line end to end (STRATA_PROF_BIN, STRATA_TRAIN_BIN):
//   - the predictor on synthetic measurements whose answer is known in closed form: a
//     compute-bound, a link-bound, an NVMe-bound and an AdamW-bound step, each with every
//     other rate made so fast that only the intended resource and the pipeline's own
//     dependencies remain;
//   - the search honours the planner (every ranked candidate fits) and, when nothing fits,
//     says what is missing on which tier;
//   - engine_config_json round-trips through parse_engine_config;
//   - the recommended ds_config is accepted by strata-train (--plan fits, a short run trains),
//     and an impossible request exits 2 naming the tiers short of memory.
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "scheduler/layout.h"
#include "scheduler/schedule.h"
#include "strata/engine.h"
#include "strata/engine_config.h"
#include "strata/perf_model.h"
#include "test_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

constexpr double kFast = 1e18;  // a rate so high its work takes no measurable time

MachineProfile fast_machine() {
  MachineProfile m;
  m.h2d_bps = m.d2h_bps = m.device_mem_bps = m.host_mem_bps = kFast;
  m.nvme_read_bps = m.nvme_write_bps = kFast;
  m.cpu_adamw_params_per_s = m.device_adamw_params_per_s = kFast;
  m.device_capacity = m.host_capacity = m.nvme_free = std::uint64_t(1) << 40;
  return m;
}

// embed, `layers` layers of `layer_numel` (a multiple of 2048: no padding), head; the
// embedding and the head are small and cost nothing.
ModelProfile synthetic(int layers, std::uint64_t layer_numel, double fwd_s, double bwd_s) {
  ModelProfile mp;
  mp.micro_batch = 2;
  mp.seq_len = 64;
  mp.units.push_back({"embed", 2048, 0, 0});
  for (int l = 0; l < layers; ++l)
    mp.units.push_back({"layers." + std::to_string(l), layer_numel, fwd_s, bwd_s});
  mp.units.push_back({"head", 2048, 0, 0});
  return mp;
}

EngineConfig placed(Tier params, Tier opt, Tier grads) {
  EngineConfig c = default_engine_config();
  auto on = [](Tier t) {
    return Placement{t == Tier::kDevice ? 1.0 : 0.0, t == Tier::kHost ? 1.0 : 0.0};
  };
  c.params = on(params);
  c.optimizer = on(opt);
  c.grads = on(grads);
  c.param_persistence_threshold = 0;  // every unit is gathered on use
  return c;
}

// The units named by the predicted schedule's intervals `what` starts with ("adamw "), in the
// order they start, space-separated.
std::string units_by_start(const Prediction& p, const std::string& what) {
  std::vector<std::pair<double, std::string>> found;
  for (const Interval& iv : p.schedule)
    if (iv.what.starts_with(what)) found.emplace_back(iv.start_s, iv.what.substr(what.size()));
  std::sort(found.begin(), found.end());
  std::string order;
  for (const auto& [t, unit] : found) order += (order.empty() ? "" : " ") + unit;
  return order;
}

constexpr std::uint64_t kLayer = 2048 * 1024;  // 2M parameters, 8 MiB in fp32
constexpr double kRel = 1e-6;

// A unit's master, m and v off the device lie state_stride(n) elements apart (layout.h): n where
// no stride of 1 to 6 arrays is within 64 KiB of a multiple of 64 MiB, else n plus one or two
// 64 KiB gaps, which take them all out.
TEST(Layout, OptimizerStateArraysAreNotAMultipleOf64MiBApart) {
  constexpr std::uint64_t kPeriod = std::uint64_t(64) << 20, kNear = 65536;
  const auto near1 = [&](std::uint64_t bytes) {
    for (std::uint64_t k = 1; k * kPeriod < bytes + kNear; ++k)
      if ((bytes > k * kPeriod ? bytes - k * kPeriod : k * kPeriod - bytes) < kNear) return true;
    return false;
  };
  const auto near = [&](std::uint64_t stride_bytes) {
    for (std::uint64_t k = 1; k <= 6; ++k)
      if (near1(k * stride_bytes)) return true;
    return false;
  };
  EXPECT_EQ(detail::state_stride(2048), 2048u);
  EXPECT_EQ(detail::state_stride(kLayer), kLayer);                         // 8 MiB, 16 MiB: no gaps
  EXPECT_EQ(detail::state_stride(1u << 23), (1u << 23) + 16384);           // v 64 MiB after master
  EXPECT_EQ(detail::state_stride(1u << 24), (1u << 24) + 16384);           // m 64 MiB after master
  EXPECT_EQ(detail::state_stride((1u << 24) - 2048), (1u << 24) + 30720);  // two gaps
  EXPECT_EQ(detail::state_elems(1u << 25), 3 * ((1u << 25) + 16384));
  EXPECT_EQ(optimizer_state_stride(1u << 25), (1u << 25) + 16384);  // the public name of it
  // Every size in whole pages around the multiples of 32 MiB up to 1 GiB.
  int padded = 0;
  for (std::uint64_t m = 1; m <= 32; ++m)
    for (std::int64_t d = -40; d <= 40; ++d) {
      const std::uint64_t n = m * (std::uint64_t(8) << 20) + std::uint64_t(d * 2048);
      const std::uint64_t st = detail::state_stride(n);
      ASSERT_GE(st, n);
      ASSERT_EQ((st - n) % detail::kStateGapElems, 0u) << n;
      ASSERT_LE(st - n, 2 * detail::kStateGapElems) << n;
      EXPECT_FALSE(near(4 * st)) << n << " -> " << st;
      EXPECT_EQ(st == n, !near(4 * n)) << n;
      padded += st != n;
    }
  // Padded: the 15 sizes within 64 KiB of each multiple of 64 MiB, and the 7 within 24 KiB of each
  // odd multiple of 32 MiB (twice them within 64 KiB of 64 MiB; 4 and 6 times them add none).
  EXPECT_EQ(padded, 16 * 7 + 16 * 15);
  // The gaps' bytes: the host's one block, NVMe's one record a sub-group, the device's none.
  const std::uint64_t n = std::uint64_t(1) << 24;
  EXPECT_EQ(detail::state_gap_bytes(n, n, Tier::kHost), 3u * 65536);
  EXPECT_EQ(detail::state_gap_bytes(n, n, Tier::kDevice), 0u);
  EXPECT_EQ(detail::state_gap_bytes(3 * n, n, Tier::kNvme), 3 * 3u * 65536);
  EXPECT_EQ(detail::state_gap_bytes(n + kLayer, n, Tier::kNvme), 3u * 65536);  // 8 MiB last: none
  EXPECT_EQ(detail::state_gap_bytes(n + kLayer, n, Tier::kHost), 0u);          // 72 MiB: none
}

// The fetch rules the engine and the replay share (schedule.h): what prefetch takes, when a
// fetch releases, and which unit goes.
TEST(Schedule, PrefetchTheLiveBudgetAndTheUnitReleased) {
  EngineConfig c;
  c.prefetch_bucket_size = 300;
  c.max_live_parameters = 1000;
  EXPECT_TRUE(detail::prefetch_fits(c, 0, 0, 300));
  EXPECT_FALSE(detail::prefetch_fits(c, 100, 0, 201));   // past the bucket
  EXPECT_FALSE(detail::prefetch_fits(c, 0, 800, 201));   // past the live budget
  EXPECT_TRUE(detail::prefetch_fits(c, 100, 800, 200));  // both exactly full
  c.prefetch_bucket_size = 0;                            // no prefetch
  EXPECT_FALSE(detail::prefetch_fits(c, 0, 0, 2));
  EXPECT_FALSE(detail::over_live_budget(c, 600, 400));
  EXPECT_TRUE(detail::over_live_budget(c, 601, 400));

  // Belady: the releasable unit used furthest ahead; the first of a tie; n when none.
  const std::vector<bool> releasable = {true, false, true, true, true};
  const std::vector<std::size_t> next = {7, 99, 3, 7, 5};
  auto victim = [&](const std::vector<bool>& r) {
    return detail::release_victim(
        r.size(), [&](std::size_t i) { return bool(r[i]); },
        [&](std::size_t i) { return next[i]; });
  };
  EXPECT_EQ(victim(releasable), 0u);  // 0 and 3 tie at 7; unit 1 (99) is not releasable
  EXPECT_EQ(victim({false, false, true, false, true}), 4u);
  EXPECT_EQ(victim({false, false, false, false, false}), 5u);
}

TEST(PerfModel, ComputeBoundStepIsTheComputeTime) {
  const ModelProfile mp = synthetic(4, kLayer, 0.010, 0.020);
  const Prediction p =
      predict_step(fast_machine(), mp, placed(Tier::kDevice, Tier::kDevice, Tier::kDevice));
  EXPECT_NEAR(p.step_s, 4 * (0.010 + 0.020), 0.120 * kRel);
  EXPECT_EQ(p.bottleneck, Resource::kCompute);
  EXPECT_NEAR(p.busy_s[int(Resource::kCompute)], 0.120, 0.120 * kRel);
  EXPECT_NEAR(p.tokens_per_s, 128 / p.step_s, 1e-6);
  // Two micro-batches of accumulation: twice the compute, one optimizer step.
  EngineConfig c = placed(Tier::kDevice, Tier::kDevice, Tier::kDevice);
  c.gradient_accumulation_steps = 2;
  EXPECT_NEAR(predict_step(fast_machine(), mp, c).step_s, 0.240, 0.240 * kRel);
}

// Beyond 8 micro-batches a step replays four (the first, two in the middle, the last) and the
// steady one of the middle stands for those left out: the prediction continues the full replay's
// line (each one more micro-batch adds what the eighth added to the seventh), in closed form where
// there is one, and the replay no longer grows with gradient_accumulation_steps (it replayed every
// micro-batch, for every candidate and fixed-point pass: 2^62 hung, 10^9 took 24 GB).
TEST(PerfModel, ManyMicroBatchesReplayTheSteadyOneScaled) {
  const ModelProfile mp = synthetic(4, kLayer, 0.010, 0.020);
  struct Case {
    const char* name;
    MachineProfile m;
    EngineConfig c;
  };
  std::vector<Case> cases;
  cases.push_back({"compute", fast_machine(), placed(Tier::kDevice, Tier::kDevice, Tier::kDevice)});
  {
    MachineProfile m = fast_machine();
    m.h2d_bps = 1e9;
    EngineConfig c = placed(Tier::kHost, Tier::kDevice, Tier::kDevice);
    c.max_live_parameters = 2 * kLayer;  // a window: every layer over the link again in backward
    c.prefetch_bucket_size = kLayer;
    cases.push_back({"window", m, c});
  }
  {
    MachineProfile m = fast_machine();
    m.nvme_read_bps = m.nvme_write_bps = 1e9;
    EngineConfig c = placed(Tier::kDevice, Tier::kNvme, Tier::kNvme);
    c.optimizer_nvme_paths = c.grad_nvme_paths = {"/tmp"};
    cases.push_back({"nvme gradients", m, c});
  }
  {
    MachineProfile m = fast_machine();  // the early step, on one shared core
    m.cpu_adamw_params_per_s = double(kLayer) / 0.015;
    m.device_kernel_threads = 1;
    m.device_shares_host_cores = 1;
    EngineConfig c = placed(Tier::kDevice, Tier::kHost, Tier::kHost);
    c.optimizer_threads = 1;
    cases.push_back({"shared core", m, c});
  }
  const auto last_end = [](const Prediction& p) {
    double last = 0;
    for (const Interval& iv : p.schedule) last = std::max(last, iv.end_s);
    return last;
  };
  for (Case& k : cases) {
    SCOPED_TRACE(k.name);
    const auto at = [&](std::int64_t accum) {
      k.c.gradient_accumulation_steps = accum;
      return predict_step(k.m, mp, k.c);
    };
    // (on shared cores the replay is a fixed point, settled to 1e-3 of the step)
    const double rel = k.m.device_shares_host_cores > 0 ? 2e-3 : 1e-6;
    const Prediction p7 = at(7), p8 = at(8), p9 = at(9);
    const double each = p8.step_s - p7.step_s;
    for (const std::int64_t accum : {9, 10, 1000}) {
      const Prediction p = at(accum);
      const double want = p8.step_s + double(accum - 8) * each;
      EXPECT_NEAR(p.step_s, want, want * rel) << accum;
      for (int r = 0; r < int(Resource::kCount); ++r) {
        const double busy = p8.busy_s[r] + double(accum - 8) * (p8.busy_s[r] - p7.busy_s[r]);
        EXPECT_NEAR(p.busy_s[r], busy, want * rel) << accum << " " << r;
      }
      EXPECT_EQ(p.schedule.size(), p9.schedule.size()) << accum;
      // The last micro-batch and the update moved to the step's end: as far past it (the early
      // step's work finishing behind) as with 8.
      EXPECT_NEAR(last_end(p) - p.step_s, last_end(p8) - p8.step_s, p.step_s * rel) << accum;
    }
  }
  // Compute-bound: A micro-batches of 120 ms, whatever A.
  EngineConfig c = placed(Tier::kDevice, Tier::kDevice, Tier::kDevice);
  c.gradient_accumulation_steps = std::int64_t(1) << 62;
  const Prediction p = predict_step(fast_machine(), mp, c);
  EXPECT_NEAR(p.step_s, 0.120 * double(c.gradient_accumulation_steps), p.step_s * 1e-6);
  EXPECT_NEAR(p.tokens_per_s, 128 / 0.120, 1e-3);
}

// Tensor parallelism: a unit's TP collectives are part of its measured time; the replay shows
// them on the "tp" lane, on the compute stream after the unit's compute (bytes at the measured
// all-reduce rate, at most 90% of the unit), and the step is what it was without them shown.
TEST(PerfModel, TensorParallelAllReducesHoldTheComputeStreamOnTheirLane) {
  ModelProfile mp = synthetic(4, kLayer, 0.010, 0.020);
  const EngineConfig c = placed(Tier::kDevice, Tier::kDevice, Tier::kDevice);
  const Prediction plain = predict_step(fast_machine(), mp, c);
  MachineProfile m = fast_machine();
  m.tensor_parallel = 2;
  m.tp_all_reduce_bps = 1e9;
  for (std::size_t i = 1; i + 1 < mp.units.size(); ++i) {
    mp.units[i].tp_forward_bytes = 2'000'000;   // 2 ms of the forward's 10
    mp.units[i].tp_backward_bytes = 3'000'000;  // 3 ms of the backward's 20
  }
  const Prediction p = predict_step(m, mp, c);
  EXPECT_NEAR(p.step_s, plain.step_s, plain.step_s * kRel);
  EXPECT_NEAR(p.busy_s[int(Resource::kTp)], 4 * 0.005, 0.020 * kRel);
  EXPECT_NEAR(p.busy_s[int(Resource::kCompute)], 4 * 0.025, 0.100 * kRel);
  std::size_t tp_ops = 0;
  for (const Interval& iv : p.schedule) {
    if (iv.lane != Resource::kTp) continue;
    ++tp_ops;
    EXPECT_EQ(iv.stream, "compute") << iv.what;
    EXPECT_TRUE(iv.what.starts_with("tp fwd layers.") || iv.what.starts_with("tp bwd layers."))
        << iv.what;
    EXPECT_EQ(iv.bytes, iv.what.starts_with("tp fwd") ? 2'000'000u : 3'000'000u) << iv.what;
    // Right after the unit's compute, which ends where it starts.
    bool after_compute = false;
    for (const Interval& c2 : p.schedule)
      after_compute |= c2.lane == Resource::kCompute && c2.what == iv.what.substr(3) &&
                       std::abs(c2.end_s - iv.start_s) < 1e-12;
    EXPECT_TRUE(after_compute) << iv.what;
  }
  EXPECT_EQ(tp_ops, 8u);  // 4 layers, forward and backward
  // A rate slower than the unit's own measured time: capped at 90% of it.
  m.tp_all_reduce_bps = 1e6;
  const Prediction slow = predict_step(m, mp, c);
  EXPECT_NEAR(slow.step_s, plain.step_s, plain.step_s * kRel);
  EXPECT_NEAR(slow.busy_s[int(Resource::kTp)], 0.9 * 4 * 0.030, 0.108 * kRel);
  EXPECT_EQ(slow.bottleneck, Resource::kTp);
}

// The unit gradients alive, as the engine bounds them (Engine::grad_buffer): without
// overlap_comm a unit's backward starts only once the last unit's reduce has freed its gradient,
// so backward and reduce alternate; with it a unit's backward runs beside the last one's reduce
// and the third waits for the first. Gradients on the device, one rank: each reduce is the
// accumulation on the comm stream (12 bytes an element at the device's memory rate: 30 ms a
// layer here, its zero fill 10 ms on the compute stream, its backward 20).
TEST(PerfModel, UnitGradientsAliveAreBoundedAsTheEngineBoundsThem) {
  const ModelProfile mp = synthetic(4, kLayer, 0.010, 0.020);
  MachineProfile m = fast_machine();
  m.device_mem_bps = 4.0 * double(kLayer) / 0.010;
  EngineConfig c = placed(Tier::kDevice, Tier::kDevice, Tier::kDevice);
  c.overlap_comm = false;
  const Prediction serial = predict_step(m, mp, c);
  c.overlap_comm = true;
  const Prediction overlapped = predict_step(m, mp, c);
  // Without: four layers of (backward + fill, then the accumulation), one after the other (the
  // embedding's gradient waits for the last layer's).
  EXPECT_NEAR(serial.backward_s, 4 * 0.060, 1e-3);
  // With: the compute chain (30 ms a layer) runs one accumulation behind, the third layer's
  // gradient waiting for the first's reduce (60 ms), the fourth for the second's (90 ms), the
  // embedding's for the third's (120 ms).
  EXPECT_NEAR(overlapped.backward_s, 0.120, 1e-3);
  EXPECT_GT(serial.step_s, overlapped.step_s + 0.080);
}

TEST(PerfModel, LinkBoundStepIsTheTransfersPlusTheLastComputes) {
  // Weights on the host behind a 1 GB/s link; every layer stays gathered into backward (the
  // default live budget), so the link carries each layer once: the forward is the fetch chain
  // plus the last layer's forward, the backward only computes.
  MachineProfile m = fast_machine();
  m.h2d_bps = 1e9;
  const ModelProfile mp = synthetic(4, kLayer, 0.001, 0.001);
  const Prediction p = predict_step(m, mp, placed(Tier::kHost, Tier::kDevice, Tier::kDevice));
  const double fetch = double(kLayer) * 4 / 1e9, small = 2048.0 * 4 / 1e9;
  EXPECT_EQ(p.bottleneck, Resource::kH2D);
  EXPECT_NEAR(p.busy_s[int(Resource::kH2D)], 4 * fetch + 2 * small, 1e-9);
  const double expect =
      small + 4 * fetch + 0.001 /* layer 3 fwd */ + small /* head fetch after it */ + 4 * 0.001;
  EXPECT_NEAR(p.step_s, expect, expect * 1e-3);
  // A window of two layers: evicted in forward, every layer crosses the link again in backward.
  EngineConfig c = placed(Tier::kHost, Tier::kDevice, Tier::kDevice);
  c.max_live_parameters = 2 * kLayer;
  c.prefetch_bucket_size = kLayer;
  const Prediction w = predict_step(m, mp, c);
  EXPECT_GT(w.busy_s[int(Resource::kH2D)], 1.4 * p.busy_s[int(Resource::kH2D)]);
  EXPECT_GT(w.step_s, p.step_s);
}

TEST(PerfModel, NvmeBoundStepIsTheDrivesBytes) {
  // Optimizer state on NVMe at 1 GB/s each way: read one unit ahead, written behind; the drive
  // never idles in the step, so the step is its bytes (12 read + 12 written per parameter).
  MachineProfile m = fast_machine();
  m.nvme_read_bps = m.nvme_write_bps = 1e9;
  const ModelProfile mp = synthetic(4, kLayer, 0, 0);
  const Prediction p = predict_step(m, mp, placed(Tier::kDevice, Tier::kNvme, Tier::kHost));
  const double params = 4.0 * double(kLayer) + 2 * 2048;
  EXPECT_EQ(p.bottleneck, Resource::kNvme);
  EXPECT_NEAR(p.busy_s[int(Resource::kNvme)], 24 * params / 1e9, 1e-9);
  EXPECT_NEAR(p.step_s, 24 * params / 1e9, 24 * params / 1e9 * 1e-3);
  // The early optimizer step ran the state traffic as gradients arrived; without it, all of
  // it is in step() and the step is the same drive bytes.
  EngineConfig serial = placed(Tier::kDevice, Tier::kNvme, Tier::kHost);
  serial.overlap_optimizer = false;
  const Prediction q = predict_step(m, mp, serial);
  EXPECT_NEAR(q.step_s, 24 * params / 1e9, 24 * params / 1e9 * 1e-3);
  EXPECT_NEAR(q.optimizer_s, q.step_s, 1e-6);
}

TEST(PerfModel, GradientsOnNvmeAddTheirBytesToTheDrive) {
  // Beside NVMe optimizer state: each micro-batch writes every gradient shard (the second reads
  // it back first to add to), and the optimizer reads it with the state: 4 + 4 more bytes a
  // parameter with one micro-batch, 8 + 8 with two. The drive is the bottleneck.
  MachineProfile m = fast_machine();
  m.nvme_read_bps = m.nvme_write_bps = 1e9;
  const ModelProfile mp = synthetic(4, kLayer, 0, 0);
  const double params = 4.0 * double(kLayer) + 2 * 2048;
  EngineConfig c = placed(Tier::kDevice, Tier::kNvme, Tier::kNvme);
  c.optimizer_nvme_paths = c.grad_nvme_paths = {"/tmp"};
  for (int accum : {1, 2}) {
    c.gradient_accumulation_steps = accum;
    const Prediction p = predict_step(m, mp, c);
    const double bytes = (24 + 8 * accum) * params;
    EXPECT_EQ(p.bottleneck, Resource::kNvme) << accum;
    EXPECT_NEAR(p.busy_s[int(Resource::kNvme)], bytes / 1e9, 1e-9) << accum;
    EXPECT_GE(p.step_s, bytes / 1e9 * (1 - 1e-9)) << accum;
    EXPECT_LT(p.step_s, 1.1 * bytes / 1e9) << accum;
  }
}

// Reads and writes sharing the drive pay a per-request part beside their bytes
// (MachineProfile::nvme_mixed_request_s, measured at two request sizes): every NVMe request of
// the optimizer's and the gradients' traffic, written or read, holds the drive that much longer.
TEST(PerfModel, EachMixedRequestPaysItsFixedPart) {
  MachineProfile m = fast_machine();
  m.nvme_read_bps = m.nvme_write_bps = m.nvme_mixed_bps = 1e9;
  const ModelProfile mp = synthetic(4, kLayer, 0, 0);
  EngineConfig c = placed(Tier::kDevice, Tier::kNvme, Tier::kNvme);
  c.optimizer_nvme_paths = c.grad_nvme_paths = {"/tmp"};
  c.sub_group_size = kLayer / 4;
  const Prediction bytes_only = predict_step(m, mp, c);
  m.nvme_mixed_request_s = 1e-3;
  const Prediction p = predict_step(m, mp, c);
  std::size_t requests = 0, writes = 0;
  for (const Interval& iv : p.schedule)
    if (iv.lane == Resource::kNvme) {
      ++requests;
      writes += iv.what.starts_with("write");
    }
  EXPECT_GT(writes, 4u * 4);  // every layer's sub-groups of state, and its gradient
  EXPECT_GT(requests, writes);
  EXPECT_NEAR(p.busy_s[int(Resource::kNvme)] - bytes_only.busy_s[int(Resource::kNvme)],
              1e-3 * double(requests), 1e-9);
}

// MachineProfile::nvme_mixed_deep_request_s: the more requests wait on the drive, the more of
// their per-request part overlaps. A configuration pays the part at the depth it keeps in flight
// (its read ahead, offload_optimizer.buffer_count - 2 state writes behind, 2 new-weight writes
// behind with weights on NVMe), between the profile's two depths.
TEST(PerfModel, TheMixedRequestPartIsTakenAtTheDepthInFlight) {
  MachineProfile m = fast_machine();
  m.nvme_mixed_request_s = 0.004;                   // at 4 in flight
  EXPECT_DOUBLE_EQ(mixed_request_at(m, 9), 0.004);  // no deep one measured: the same at any depth
  m.nvme_mixed_deep_request_s = 0.002;              // at 8
  EXPECT_DOUBLE_EQ(mixed_request_at(m, 3), 0.004);
  EXPECT_DOUBLE_EQ(mixed_request_at(m, 6), 0.003);
  EXPECT_DOUBLE_EQ(mixed_request_at(m, 9), 0.002);

  m.nvme_read_bps = m.nvme_write_bps = m.nvme_mixed_bps = 1e9;
  m.nvme_mixed_request_s = 1e-3;
  m.nvme_mixed_deep_request_s = 0;
  const ModelProfile mp = synthetic(4, kLayer, 0, 0);
  EngineConfig c = placed(Tier::kDevice, Tier::kNvme, Tier::kHost);
  c.optimizer_nvme_paths = {"/tmp"};
  c.sub_group_size = kLayer / 4;
  c.overlap_optimizer = false;  // one step replayed: every request in its window
  MachineProfile bytes_only = m;
  bytes_only.nvme_mixed_request_s = bytes_only.nvme_mixed_deep_request_s = 0;
  auto extra_per_request = [&](const EngineConfig& cfg) {
    const Prediction p = predict_step(m, mp, cfg);
    std::size_t requests = 0;
    for (const Interval& iv : p.schedule) requests += iv.lane == Resource::kNvme;
    return (p.busy_s[int(Resource::kNvme)] -
            predict_step(bytes_only, mp, cfg).busy_s[int(Resource::kNvme)]) /
           double(requests);
  };
  c.optimizer_buffer_count = 4;  // 1 + 2 in flight: the part at 4
  EXPECT_NEAR(extra_per_request(c), 1e-3, 1e-9);
  c.optimizer_buffer_count = 7;  // 1 + 5 in flight: half way to the deep one
  EXPECT_NEAR(extra_per_request(c), 0.5e-3, 1e-9);
  c.optimizer_buffer_count = 8;  // 1 + 6 in flight
  EXPECT_NEAR(extra_per_request(c), 0.25e-3, 1e-9);
  c.params = {0, 0};  // and weights on NVMe: 1 + 6 + 2, the deep one
  c.param_nvme_paths = {"/tmp"};
  EXPECT_NEAR(extra_per_request(c), 0, 1e-9);
}

TEST(PerfModel, EarlyOptimizerStepOverlapsBackward) {
  // 4 layers, 10 ms forward and 20 ms backward each; the CPU AdamW takes 15 ms a layer. The
  // early step runs each layer's AdamW after its backward, in the shadow of the next layer's:
  // the step is the compute plus the last layer's AdamW. Serial, it is the compute plus all.
  MachineProfile m = fast_machine();
  m.cpu_adamw_params_per_s = double(kLayer) / 0.015;
  const ModelProfile mp = synthetic(4, kLayer, 0.010, 0.020);
  const Prediction p = predict_step(m, mp, placed(Tier::kDevice, Tier::kHost, Tier::kHost));
  const double small = 2.0 * 2048 / double(kLayer) * 0.015;  // embed and head AdamW
  EXPECT_NEAR(p.step_s, 0.120 + 0.015 + small / 2, 1e-6);
  EngineConfig serial = placed(Tier::kDevice, Tier::kHost, Tier::kHost);
  serial.overlap_optimizer = false;
  EXPECT_NEAR(predict_step(m, mp, serial).step_s, 0.120 + 4 * 0.015 + small, 1e-6);
  // An AdamW slower than backward bounds the step: every layer's AdamW back to back (and the
  // embedding's; the head's runs during forward), then a gap until the next step's first
  // gradient. The worker takes, of the jobs whose gradient is there, the unit the next forward
  // needs first: after layer 3 (at 70 ms) it takes layer 1, not layer 2 (both there), and
  // step() does not wait for it, so that forward runs the embedding, layers 0 and 1 under the
  // AdamW of the ones it left (embedding, 0, then 2): the gap is the forward of layers 2-3 and
  // the backward of layer 3. Taken in the order the gradients came (3, 2, 1, then 0), the
  // forward of layer 1 was in the gap too (10 ms more); without finishing behind, the whole
  // forward (20 ms more).
  m.cpu_adamw_params_per_s = double(kLayer) / 0.050;
  const Prediction a = predict_step(m, mp, placed(Tier::kDevice, Tier::kHost, Tier::kHost));
  EXPECT_EQ(a.bottleneck, Resource::kCpu);
  const double small_a = 2.0 * 2048 / double(kLayer) * 0.050;
  EXPECT_NEAR(a.step_s, 4 * 0.050 + small_a / 2 + 0.020 + 0.020, 1e-6);
  // The AdamW jobs in the predicted step, by start: the last step's backlog (layer 1 running
  // when the step begins), then this step's head, layer 3, layer 1 and the embedding (layers 0
  // and 2 fall in the next step).
  EXPECT_EQ(units_by_start(a, "adamw "),
            "layers.1 embed layers.0 layers.2 head layers.3 layers.1 embed");
}

// The early worker's choice of its next job (EarlyStepper::next_job, replayed by the
// perf model): the job read ahead, else the ready one the next forward needs first, else the
// oldest (the next to be ready: the comm stream completes gradients in order).
TEST(PerfModel, TheEarlyWorkerTakesReadyJobsInTheForwardsOrder) {
  struct Q {
    std::size_t unit;
    bool ready;
  };
  auto pick = [](const std::vector<Q>& q, std::size_t read_ahead) {
    return q[detail::next_early_job(
                 q.size(), [&](std::size_t i) { return q[i].unit == read_ahead; },
                 [&](std::size_t i) { return q[i].ready; },
                 [&](std::size_t i) { return q[i].unit; })]
        .unit;
  };
  // Queued as backward produces them: the last layers first.
  EXPECT_EQ(pick({{14, true}, {13, true}, {12, false}, {11, false}}, SIZE_MAX), 13u);
  EXPECT_EQ(pick({{14, true}, {13, false}, {12, false}}, SIZE_MAX), 14u);
  EXPECT_EQ(pick({{14, false}, {13, false}}, SIZE_MAX), 14u);      // none ready: the oldest
  EXPECT_EQ(pick({{14, true}, {13, true}, {12, true}}, 14), 14u);  // its state was read ahead
  EXPECT_EQ(pick({{14, true}, {13, true}}, 7), 13u);  // (a read-ahead for a job not queued)
  EXPECT_EQ(pick({{5, true}}, SIZE_MAX), 5u);
}

// As the engine (Engine.KeptEarlyWeightsReachTheDeviceInTheForwardsOrder): the new weights of
// kept early work go to the device in the next forward's order. With an AdamW slower than
// backward, layers 3 and 2 are done when step() ends and the embedding and layers 1 and 0 are
// not: their copies used to go first, ahead of the embedding's the forward needs first.
TEST(PerfModel, KeptEarlyWeightsGoToTheDeviceInTheForwardsOrder) {
  MachineProfile m = fast_machine();
  m.cpu_adamw_params_per_s = double(kLayer) / 0.050;
  m.h2d_bps = double(kLayer) * 2 / 0.005;  // a layer's bf16 weights in 5 ms
  const ModelProfile mp = synthetic(4, kLayer, 0.010, 0.020);
  EngineConfig c = placed(Tier::kDevice, Tier::kHost, Tier::kHost);
  c.compute_dtype = DType::kBF16;
  const Prediction p = predict_step(m, mp, c);
  EXPECT_EQ(units_by_start(p, "h2d w "), "embed layers.0 layers.1 layers.2 layers.3 head");
}

// strata-prof --validate's choice of the fastest validated candidate: by tokens a second, as the
// search ranks, not by step time (a B=8 step of 317 ms beat a B=4 one of 182 ms and was called
// "73.9% slower").
TEST(PerfModel, FastestValidatedIsByTokensASecond) {
  std::vector<Candidate> c(3);
  c[0].prediction.step_s = 0.3, c[0].prediction.tokens_per_s = 8 * 32 / 0.3;    // B=8
  c[1].prediction.step_s = 0.15, c[1].prediction.tokens_per_s = 4 * 32 / 0.15;  // B=4
  c[2].prediction.step_s = 0.3, c[2].prediction.tokens_per_s = 8 * 32 / 0.3;
  EXPECT_EQ(fastest_validated(c, {0.317, 0.182}), 0u);  // 808 against 703 tokens/s
  EXPECT_NEAR(measured_tokens_per_s(c[0], 0.317), 8 * 32 / 0.317, 1e-9);
  EXPECT_EQ(fastest_validated(c, {0.317, 0.150}), 1u);   // 853: faster
  EXPECT_EQ(fastest_validated(c, {0, 0.182, 0.4}), 1u);  // a failed run is not the fastest
  EXPECT_EQ(fastest_validated(c, {0, 0}), 2u);           // none ran
}

// strata-prof --validate's rank correlation: Spearman's, ties at their mean rank.
TEST(PerfModel, SpearmanRanksAsTheTextbookDoes) {
  EXPECT_DOUBLE_EQ(*spearman({1, 2, 3, 4}, {10, 20, 30, 40}), 1.0);
  EXPECT_DOUBLE_EQ(*spearman({1, 2, 3, 4}, {9, 7, 5, 1}), -1.0);
  // ties (7, 7) at rank 3.5: numpy's corrcoef of the ranks
  EXPECT_NEAR(*spearman({1, 2, 3, 4, 5}, {5, 6, 7, 8, 7}), 0.8207826816681234, 1e-12);
  EXPECT_DOUBLE_EQ(*spearman({1, 2, 3}, {1, 3, 2}), 0.5);    // 1 - 6 * 2 / (3 * 8)
  EXPECT_FALSE(spearman({1, 2}, {1, 2}).has_value());        // too few to rank
  EXPECT_FALSE(spearman({1, 2, 3}, {4, 4, 4}).has_value());  // no order on one side
  EXPECT_THROW(spearman({1, 2, 3}, {1, 2}), Error);
}

// With a resolution, values closer than it tie on both sides: five candidates predicted within
// 0.2% and measured within 0.5% in any order are not a wrong ranking (strata-prof's compute
// regime), while an order the runs can tell apart still counts whole.
TEST(PerfModel, SpearmanTiesWhatTheResolutionCannotTellApart) {
  const std::vector<double> pred = {1000, 999, 998.5, 998.2, 998, 800, 760};
  const std::vector<double> meas = {996, 998, 999, 995, 997, 805, 770};
  EXPECT_LT(*spearman(pred, meas), 0.8);               // the near-ties' order is noise
  EXPECT_DOUBLE_EQ(*spearman(pred, meas, 0.01), 1.0);  // 1%: one group of five, then two
  EXPECT_DOUBLE_EQ(*spearman(pred, meas, 0.0), *spearman(pred, meas));
  // A swap beyond the resolution still counts: 800 and 760 measured the other way round (ranks
  // 4 x5, 1, 0 against 4 x5, 0, 1: 17/18), and the near-ties measured slowest reverse it.
  std::vector<double> swapped = meas;
  std::swap(swapped[5], swapped[6]);
  EXPECT_NEAR(*spearman(pred, swapped, 0.01), 17.0 / 18.0, 1e-12);
  EXPECT_NEAR(*spearman(pred, {700, 702, 701, 703, 700.5, 805, 770}, 0.01), -17.0 / 18.0, 1e-12);
  // Pair by pair, not chained: at 1%, 100.8 cannot be told from 100 nor from 101.6, but 101.6 is
  // 1.6% above 100 (ranks 0.5, 1, 1.5), so the order of the outer two shows: against 1, 1, 2
  // (ranks 0.5, 0.5, 2) 0.75 / sqrt(0.5 x 1.5).
  EXPECT_NEAR(*spearman({100, 100.8, 101.6}, {1, 1, 2}, 0.01), std::sqrt(0.75), 1e-12);
  EXPECT_DOUBLE_EQ(*spearman({100, 100.8, 101.6}, {3, 2, 1}, 0.01), -1.0);
  EXPECT_FALSE(spearman({100, 100.8, 101.6}, {1, 2, 3}, 0.02).has_value());  // all within 2%
  EXPECT_THROW(spearman(pred, meas, -0.1), Error);
}

// The same runs rank alike as tokens/s and as step times: strata-prof's link regime on the AMD
// EPYC Zen 5 VM (2026-12-05), seven candidates' predicted and measured steps (ms) at its 0.6%
// resolution. Groups anchored at their smallest value gave 0.66 over tokens/s (491.35 ms fell in
// 494.09's group, 0.2% from 490.42 in the next) and 1.00 over step times.
TEST(PerfModel, SpearmanWithTiesIsTheSameForRatesAndForTimes) {
  const std::vector<double> pred_ms = {483.74, 484.07, 484.23, 484.37, 487.08, 515.33, 998.6};
  const std::vector<double> meas_ms = {490.42, 491.35, 489.34, 489.54, 494.09, 531.82, 1014.8};
  std::vector<double> pred_tps, meas_tps;
  for (double x : pred_ms) pred_tps.push_back(1000 / x);
  for (double x : meas_ms) meas_tps.push_back(1000 / x);
  const double by_time = *spearman(pred_ms, meas_ms, 0.006);
  EXPECT_NEAR(*spearman(pred_tps, meas_tps, 0.006), by_time, 1e-12);
  EXPECT_NEAR(by_time, 0.9759782669371166, 1e-12);
  // Without the resolution the near-ties' order counts as if the runs could tell it.
  EXPECT_NEAR(*spearman(pred_ms, meas_ms), 0.7142857142857143, 1e-12);
}

// A run's step-to-step spread: the interquartile range of its steps over their median.
TEST(PerfModel, StepSpreadIsTheInterquartileRangeOverTheMedian) {
  // sorted 80 82 84 85 86 88 90: quartiles at ranks 1 and 5 (82, 88), median 85
  EXPECT_DOUBLE_EQ(step_spread({85, 90, 80, 84, 88, 82, 86}), (88.0 - 82.0) / 85.0);
  EXPECT_DOUBLE_EQ(step_spread({0.5, 0.5, 0.5, 0.5}), 0.0);
  EXPECT_DOUBLE_EQ(step_spread({0.5}), 0.0);
  EXPECT_DOUBLE_EQ(step_spread({}), 0.0);
}

// strata-prof's reduction of a layer's repeated timings: the mean without the smallest and the
// largest. Two groups (a copy's first repetitions slow, the later fast) give a value between
// them that a one-sided change of one repetition moves a little, where the median jumps.
TEST(PerfModel, TrimmedMeanDropsTheSmallestAndTheLargest) {
  EXPECT_DOUBLE_EQ(trimmed_mean({5.5, 5.6, 3.5, 5.4, 3.4, 3.6, 5.5, 3.5, 100.0}),
                   (3.5 + 3.5 + 3.6 + 5.4 + 5.5 + 5.5 + 5.6) / 7.0);
  // 5 slow and 4 fast, then 4 slow and 5 fast: the median goes from one group to the other,
  // the trimmed mean moves by a seventh of the gap.
  const std::vector<double> a{5.5, 5.5, 5.5, 5.5, 5.5, 3.5, 3.5, 3.5, 3.5},
      b{5.5, 5.5, 5.5, 5.5, 3.5, 3.5, 3.5, 3.5, 3.5};
  EXPECT_NEAR(trimmed_mean(a) - trimmed_mean(b), 2.0 / 7.0, 1e-12);
  EXPECT_DOUBLE_EQ(trimmed_mean({2.0, 4.0}), 3.0);  // fewer than 3: the plain mean
  EXPECT_DOUBLE_EQ(trimmed_mean({7.0}), 7.0);
  EXPECT_DOUBLE_EQ(trimmed_mean({}), 0.0);
  EXPECT_DOUBLE_EQ(trimmed_mean({1.0, 2.0, 9.0}), 2.0);
}

// How far a candidate's rounds came apart: slowest over fastest, less one.
TEST(PerfModel, RoundDriftIsTheSlowestRoundOverTheFastest) {
  EXPECT_DOUBLE_EQ(round_drift({0.1293, 0.097}), (0.1293 - 0.097) / 0.097);
  EXPECT_DOUBLE_EQ(round_drift({0.097, 0.1293}), (0.1293 - 0.097) / 0.097);  // either order
  EXPECT_DOUBLE_EQ(round_drift({0.2, 0.1, 0.15}), 1.0);
  EXPECT_DOUBLE_EQ(round_drift({0.08}), 0.0);  // one round: nothing to drift from
  EXPECT_DOUBLE_EQ(round_drift({}), 0.0);
}

// A ranked candidate of the given placement (nothing else of it matters to the picks).
Candidate ranked_as(Tier params, Tier opt, Tier grads, bool early = false) {
  Candidate c;
  c.config = placed(params, opt, grads);
  c.plan.early_optimizer_step = early;
  return c;
}

TEST(PerfModel, PlacementClassNamesEveryPiecesTiers) {
  Candidate c = ranked_as(Tier::kHost, Tier::kDevice, Tier::kHost, true);
  c.config.params = Placement{0, 0.5};  // half host, half NVMe
  EXPECT_EQ(placement_class(c), "params host+nvme, optimizer device, grads host, early step");
  c.config.optimizer = Placement{0.5, 0.5};
  c.plan.early_optimizer_step = false;
  EXPECT_EQ(placement_class(c), "params host+nvme, optimizer device+host, grads host");
  // The window, micro-batch and checkpointing are not the class.
  Candidate d = c;
  d.config.max_live_parameters = 1234;
  d.micro_batch = 8;
  d.checkpoint = true;
  EXPECT_EQ(placement_class(d), placement_class(c));
}

// --validate K's spread: the best-ranked of each class not among the top, then low-ranked ones.
TEST(PerfModel, ValidationPicksSpreadOverClassesAndRanks) {
  using T = Tier;
  const std::vector<Candidate> r = {
      ranked_as(T::kHost, T::kHost, T::kHost),        // 0  A
      ranked_as(T::kHost, T::kHost, T::kHost),        // 1  A
      ranked_as(T::kHost, T::kHost, T::kHost),        // 2  A
      ranked_as(T::kDevice, T::kHost, T::kHost),      // 3  B
      ranked_as(T::kHost, T::kHost, T::kHost),        // 4  A
      ranked_as(T::kNvme, T::kHost, T::kHost),        // 5  C
      ranked_as(T::kDevice, T::kHost, T::kHost),      // 6  B
      ranked_as(T::kNvme, T::kNvme, T::kNvme),        // 7  D
      ranked_as(T::kHost, T::kHost, T::kHost, true),  // 8  E: A with the early step
      ranked_as(T::kNvme, T::kNvme, T::kHost)};       // 9  F
  const auto summary = [](const std::vector<ValidationPick>& picks) {
    std::string s;
    for (const ValidationPick& p : picks) s += fmt::format("{}:{}; ", p.index, p.reason);
    return s;
  };
  // Two of the four for classes (B, C), two low: the median's rank 5 is taken, so the next, 6.
  EXPECT_EQ(summary(validation_picks(r, 2, 4)),
            "0:top; 1:top; 3:best of class; 5:best of class; 6:low-ranked (median); "
            "9:low-ranked (last); ");
  // Room for every class: each of B..F once, by its best rank; the last is F's best already.
  const std::vector<ValidationPick> wide = validation_picks(r, 2, 8);
  EXPECT_EQ(summary(wide),
            "0:top; 1:top; 3:best of class; 5:best of class; 6:low-ranked (median); "
            "7:best of class; 8:best of class; 9:best of class; ");
  std::set<std::string> classes, all;
  std::set<std::size_t> seen;
  for (const ValidationPick& p : wide) {
    classes.insert(placement_class(r[p.index]));
    EXPECT_TRUE(seen.insert(p.index).second) << "picked twice: " << p.index;
  }
  for (const Candidate& c : r) all.insert(placement_class(c));
  EXPECT_EQ(classes, all);
  EXPECT_EQ(all.size(), 6u);
  // The cap holds whatever the spread, and no candidate comes twice.
  for (std::size_t top : {0, 1, 3, 10, 12})
    for (std::size_t spread : {0, 1, 2, 3, 5, 20}) {
      const std::vector<ValidationPick> picks = validation_picks(r, top, spread);
      SCOPED_TRACE(fmt::format("top {} spread {}: {}", top, spread, summary(picks)));
      EXPECT_LE(picks.size(), std::min(r.size(), top + spread));
      std::set<std::size_t> once;
      for (const ValidationPick& p : picks) {
        EXPECT_TRUE(once.insert(p.index).second);
        EXPECT_EQ(p.reason == "top", p.index < top);
      }
      EXPECT_TRUE(std::is_sorted(picks.begin(), picks.end(),
                                 [](const auto& a, const auto& b) { return a.index < b.index; }));
    }
  // No spread: the best K only. One: the best of a new class. Classes exhausted: low-ranked.
  EXPECT_EQ(summary(validation_picks(r, 3, 0)), "0:top; 1:top; 2:top; ");
  EXPECT_EQ(summary(validation_picks(r, 3, 1)), "0:top; 1:top; 2:top; 3:best of class; ");
  const std::vector<Candidate> one_class(5, ranked_as(T::kHost, T::kHost, T::kHost));
  EXPECT_EQ(summary(validation_picks(one_class, 1, 4)),
            "0:top; 2:low-ranked (median); 4:low-ranked (last); ");
  EXPECT_EQ(summary(validation_picks(std::vector<Candidate>(2, one_class[0]), 1, 4)),
            "0:top; 1:low-ranked (last); ");
  EXPECT_TRUE(validation_picks({}, 3, 4).empty());
}

// --validate's rounds: every pick once a round, each round starting a rounds-th of the way further
// along the order, so that no pick runs twice in a row (one slow stretch of the machine would set
// its median: reversing every other round ran the first pick's last two rounds back to back, and
// those differed by 2.2% against 3.5% for its first two, over 189 validations on the AMD EPYC
// Zen 5 VM, 2026-12-05) and a drift linear in the run's place falls on every pick nearly alike.
TEST(PerfModel, ValidationRoundsRunEveryPickInTurnsNeverTwiceInARow) {
  using V = std::vector<std::size_t>;
  EXPECT_EQ(validation_order(3, 1), (V{0, 1, 2}));
  EXPECT_EQ(validation_order(7, 3),
            (V{0, 1, 2, 3, 4, 5, 6, 2, 3, 4, 5, 6, 0, 1, 4, 5, 6, 0, 1, 2, 3}));
  EXPECT_EQ(validation_order(4, 2), (V{0, 1, 2, 3, 2, 3, 0, 1}));
  EXPECT_EQ(validation_order(2, 3), (V{0, 1, 0, 1, 0, 1}));  // no more picks than rounds
  EXPECT_TRUE(validation_order(0, 2).empty());
  EXPECT_TRUE(validation_order(3, 0).empty());
  for (std::size_t k = 1; k <= 12; ++k)
    for (int R = 1; R <= 6; ++R) {
      const V o = validation_order(k, R);
      ASSERT_EQ(o.size(), k * std::size_t(R));
      std::vector<std::vector<std::size_t>> at(k);
      for (std::size_t i = 0; i < o.size(); ++i) {
        ASSERT_LT(o[i], k);
        at[o[i]].push_back(i);
      }
      double lo = 1e9, hi = -1e9;
      for (std::size_t n = 0; n < k; ++n) {
        ASSERT_EQ(at[n].size(), std::size_t(R)) << k << " picks, " << R << " rounds";
        for (std::size_t r = 0; r < std::size_t(R); ++r) {
          // once in each round
          EXPECT_EQ(at[n][r] / k, r) << k << " picks, " << R << " rounds, pick " << n;
          // a pick's runs at least half a round apart (k > 1), a whole round with k <= R
          if (r > 0 && k > 1) {
            EXPECT_GE(at[n][r] - at[n][r - 1], k <= std::size_t(R) ? k : (k + 1) / 2)
                << k << " picks, " << R << " rounds, pick " << n;
          }
        }
        double mean = 0;
        for (std::size_t i : at[n]) mean += double(i) / R;
        lo = std::min(lo, mean);
        hi = std::max(hi, mean);
      }
      // each pick's mean place within picks / rounds of the others' (k > R)
      if (k > std::size_t(R)) {
        EXPECT_LE(hi - lo, double(k) / R + 1e-9) << k << " picks, " << R << " rounds";
      }
    }
}

// A traced step's measured bottleneck: the lane busy longest, its overlapping intervals counted
// once (three NVMe requests in flight together are 1 s of the drive, not 2.2).
TEST(PerfModel, LaneBusyIsTheUnionOfEachLanesIntervals) {
  using R = Resource;
  const auto span = [](R lane, double start, double end, const char* what) {
    return Interval{lane, start, end, what, "", 0};
  };
  const std::vector<Interval> sched = {
      span(R::kCompute, 0.0, 1.0, "fwd layers.0"), span(R::kCompute, 0.5, 1.5, "adamw layers.0"),
      span(R::kCompute, 2.0, 2.5, "bwd layers.0"), span(R::kH2D, 0.0, 0.8, "copy_h2d"),
      span(R::kNvme, 0.0, 1.0, "read a"),          span(R::kNvme, 0.0, 1.0, "read b"),
      span(R::kNvme, 0.2, 0.4, "read c"),          span(R::kCpu, 3.0, 3.0, "empty"),
      span(R::kCount, 0.0, 9.0, "not a lane")};
  const LaneBusy b = lane_busy(sched);
  EXPECT_NEAR(b.busy_s[int(R::kCompute)], 2.0, 1e-12);
  EXPECT_NEAR(b.busy_s[int(R::kH2D)], 0.8, 1e-12);
  EXPECT_NEAR(b.busy_s[int(R::kNvme)], 1.0, 1e-12);
  EXPECT_EQ(b.busy_s[int(R::kCpu)], 0.0);
  EXPECT_EQ(b.busy_s[int(R::kD2H)], 0.0);
  ASSERT_TRUE(b.busiest.has_value());
  EXPECT_EQ(*b.busiest, R::kCompute);
  // The drive alone, once its requests outlast the compute.
  std::vector<Interval> more = sched;
  more.push_back(span(R::kNvme, 1.0, 2.1, "write a"));
  EXPECT_EQ(*lane_busy(more).busiest, R::kNvme);
  EXPECT_NEAR(lane_busy(more).busy_s[int(R::kNvme)], 2.1, 1e-12);
  EXPECT_FALSE(lane_busy({}).busiest.has_value());
  EXPECT_FALSE(lane_busy({span(R::kCpu, 1.0, 1.0, "empty")}).busiest.has_value());
  // Ties go to the first lane, as the prediction's bottleneck does.
  const double tied[int(R::kCount)] = {0, 2, 2, 1, 0, 0};
  EXPECT_EQ(busiest(tied), R::kH2D);
}

TEST(PerfModel, LanesOnSharedCoresShareThem) {
  // The early-step case above on a CPU-emulated device: its kernels and the CPU AdamW each
  // want one core. With two they run side by side as on separate hardware; with one, nothing
  // overlaps in effect and the core is never idle, so the step is all the work in a row:
  // 40 ms forward, 80 ms backward, 4 x 15 ms AdamW (the fluid answer; the model's replay
  // reaches it within a few percent).
  MachineProfile m = fast_machine();
  m.cpu_adamw_params_per_s = double(kLayer) / 0.015;
  m.device_kernel_threads = 1;
  const ModelProfile mp = synthetic(4, kLayer, 0.010, 0.020);
  EngineConfig c = placed(Tier::kDevice, Tier::kHost, Tier::kHost);
  c.optimizer_threads = 1;
  const double alone = predict_step(m, mp, c).step_s;
  m.device_shares_host_cores = 2;
  EXPECT_NEAR(predict_step(m, mp, c).step_s, alone, alone * 1e-6);
  m.device_shares_host_cores = 1;
  const Prediction one = predict_step(m, mp, c);
  EXPECT_NEAR(one.step_s, 0.180, 0.180 * 0.05);
  // Without the overlap there is nothing to share: the serial step is the same on one core.
  EngineConfig serial = c;
  serial.overlap_optimizer = false;
  const double serial_alone = [&] {
    MachineProfile own = m;
    own.device_shares_host_cores = 0;
    return predict_step(own, mp, serial).step_s;
  }();
  EXPECT_NEAR(predict_step(m, mp, serial).step_s, serial_alone, serial_alone * 1e-6);
}

// A copy on the CPU-emulated device keeps its measured rate beside the kernels (the OS runs the
// thread that wakes for it first) and takes its core from them: weights streamed from the host at
// memcpy speed (each copy wants a whole core) with the kernels on one core of their own, then on
// one core shared. The link is busy as long either way; the kernels stretch for it, and the
// shared core is never idle: the step is the copies and the kernels in a row.
TEST(PerfModel, CopiesKeepTheirRateAndTakeTheirCoreFromTheKernels) {
  MachineProfile m = fast_machine();
  m.h2d_bps = 1e9;
  m.host_mem_bps = 2e9;  // a copy at 1 GB/s is a whole memcpy
  m.device_kernel_threads = 1;
  const ModelProfile mp = synthetic(4, kLayer, 0.010, 0.020);
  const EngineConfig c = placed(Tier::kHost, Tier::kDevice, Tier::kDevice);
  const Prediction alone = predict_step(m, mp, c);
  m.device_shares_host_cores = 2;
  const Prediction two = predict_step(m, mp, c);
  m.device_shares_host_cores = 1;
  const Prediction one = predict_step(m, mp, c);
  const int h2d = int(Resource::kH2D), compute = int(Resource::kCompute);
  EXPECT_GT(alone.busy_s[h2d], 0.03);  // 4 layers of 8 MiB
  EXPECT_NEAR(two.step_s, alone.step_s, alone.step_s * 1e-6);
  EXPECT_NEAR(one.busy_s[h2d], alone.busy_s[h2d], alone.busy_s[h2d] * 1e-6);
  EXPECT_GT(one.busy_s[compute], alone.busy_s[compute] * 1.1);
  const double in_a_row = alone.busy_s[h2d] + alone.busy_s[compute];
  // The fluid answer; the replay's fixed point (each kernel stretched by the mean crowding over
  // its span in the replay before) lands 7% short of it here.
  EXPECT_NEAR(one.step_s, in_a_row, in_a_row * 0.1);
}

// The copies take their cores first and the kernels share what they leave: kernels that keep
// both cores busy, beside a copy that wants one, get the other core (half speed), not a fair
// 2 x 2 / 3 of the two (two thirds). So the kernels lose more than a third of the copies' time
// (the most a fair share takes from them, with every copy beside a kernel) and at most half of
// it; the copies keep their rate.
TEST(PerfModel, KernelsShareTheCoresTheCopiesLeave) {
  MachineProfile m = fast_machine();
  m.h2d_bps = 1e9;
  m.host_mem_bps = 2e9;         // a copy at 1 GB/s is a whole memcpy: one core
  m.device_kernel_threads = 2;  // the kernels keep both cores busy
  const ModelProfile mp = synthetic(4, kLayer, 0.010, 0.020);
  const EngineConfig c = placed(Tier::kHost, Tier::kDevice, Tier::kDevice);
  const Prediction alone = predict_step(m, mp, c);
  m.device_shares_host_cores = 2;
  const Prediction shared = predict_step(m, mp, c);
  const int h2d = int(Resource::kH2D), compute = int(Resource::kCompute);
  const double copies = alone.busy_s[h2d], lost = shared.busy_s[compute] - alone.busy_s[compute];
  EXPECT_GT(copies, 0.03);  // 4 layers of 8 MiB
  EXPECT_NEAR(shared.busy_s[h2d], copies, copies * 1e-6);
  EXPECT_GT(lost, copies / 3 * 1.1);
  EXPECT_LE(lost, copies / 2 * (1 + 1e-6));
}

// What the profile measured of the emulated device's kernels (ModelProfile::device_cores) is the
// share of the cores they take: the case above with the kernels given both cores' threads wants
// three cores of two while the AdamW runs; kernels measured keeping one core busy (small ones, a
// team waiting for its slowest) leave the AdamW its core, as on separate hardware.
TEST(PerfModel, KernelsTakeTheCoresTheProfileMeasured) {
  MachineProfile m = fast_machine();
  m.cpu_adamw_params_per_s = double(kLayer) / 0.015;
  ModelProfile mp = synthetic(4, kLayer, 0.010, 0.020);
  EngineConfig c = placed(Tier::kDevice, Tier::kHost, Tier::kHost);
  c.optimizer_threads = 1;
  const double alone = predict_step(m, mp, c).step_s;
  m.device_shares_host_cores = 2;
  m.device_kernel_threads = 0;  // every core
  const double crowded = predict_step(m, mp, c).step_s;
  EXPECT_GT(crowded, alone * 1.05);
  mp.device_cores = 1.0;
  EXPECT_NEAR(predict_step(m, mp, c).step_s, alone, alone * 1e-6);
  // More than the threads it has is the threads' (a measurement's noise).
  mp.device_cores = 3.0;
  EXPECT_NEAR(predict_step(m, mp, c).step_s, crowded, crowded * 1e-6);
}

// MachineProfile::nvme_compute_slowdown (strata-prof measures kernels beside the drive's
// traffic): a kernel runs that much longer for the part of it the NVMe lane is busy; the drive's
// own requests and a step without NVMe traffic are as before, and a real device takes none.
TEST(PerfModel, TheDrivesTrafficSlowsTheKernelsBesideIt) {
  MachineProfile m = fast_machine();
  m.nvme_read_bps = m.nvme_write_bps = 1e9;
  m.device_shares_host_cores = 2;
  m.device_kernel_threads = 1;  // no shortage of cores: the slowdown alone
  const ModelProfile mp = synthetic(4, kLayer, 0.010, 0.020);
  EngineConfig c = placed(Tier::kDevice, Tier::kNvme, Tier::kNvme);
  c.optimizer_nvme_paths = c.grad_nvme_paths = {"/tmp"};
  const auto compute = [](const Prediction& p) { return p.busy_s[int(Resource::kCompute)]; };
  const Prediction before = predict_step(m, mp, c);
  m.nvme_compute_slowdown = 0.5;
  const Prediction slow = predict_step(m, mp, c);
  EXPECT_GT(compute(slow), compute(before) * 1.05);
  EXPECT_LE(compute(slow), compute(before) * 1.5 * (1 + 1e-9));
  EXPECT_NEAR(slow.busy_s[int(Resource::kNvme)], before.busy_s[int(Resource::kNvme)], 1e-9);
  EXPECT_GE(slow.step_s, before.step_s);
  for (const bool device : {false, true}) {
    MachineProfile other = m;
    if (device) other.device_shares_host_cores = 0;
    const EngineConfig c2 = device ? c : placed(Tier::kDevice, Tier::kHost, Tier::kHost);
    const double with = predict_step(other, mp, c2).step_s;
    other.nvme_compute_slowdown = 0;
    EXPECT_NEAR(with, predict_step(other, mp, c2).step_s, 1e-12) << device;
  }
}

TEST(PerfModel, AdamBoundStepIsTheCpuAdamW) {
  MachineProfile m = fast_machine();
  m.cpu_adamw_params_per_s = 1e8;
  const ModelProfile mp = synthetic(4, kLayer, 0, 0);
  const Prediction p = predict_step(m, mp, placed(Tier::kDevice, Tier::kHost, Tier::kHost));
  const double params = 4.0 * double(kLayer) + 2 * 2048;
  EXPECT_EQ(p.bottleneck, Resource::kCpu);
  EXPECT_NEAR(p.step_s, params / 1e8, params / 1e8 * kRel);
}

// MachineProfile::cpu_adamw_call_s: the CPU AdamW is called once a sub-group, and each call pays
// its fixed time (the threads' start and join, measured out of the cache) on top of its
// parameters, so small sub-groups cost more than their parameters say.
TEST(PerfModel, EachAdamWCallPaysItsFixedTime) {
  MachineProfile m = fast_machine();
  m.cpu_adamw_params_per_s = 1e8;
  m.cpu_adamw_call_s = 0.001;
  const std::uint64_t n = 16 * kLayer;  // one 32M-parameter layer, the embedding and the head
  const ModelProfile mp = synthetic(1, n, 0, 0);
  const double adamw = (double(n) + 2 * 2048) / 1e8;
  EngineConfig c = placed(Tier::kDevice, Tier::kHost, Tier::kHost);
  Prediction p = predict_step(m, mp, c);
  EXPECT_EQ(p.bottleneck, Resource::kCpu);
  EXPECT_NEAR(p.step_s, adamw + 3 * 0.001, adamw * kRel);  // a call a unit
  c.sub_group_size = n / 32;
  p = predict_step(m, mp, c);
  EXPECT_NEAR(p.step_s, adamw + (32 + 2) * 0.001, adamw * kRel);
  int calls = 0;
  for (const Interval& iv : p.schedule) calls += iv.what == "adamw layers.0";
  EXPECT_EQ(calls, 32);
}

// zero_optimization.sub_group_size: the engine steps a unit's NVMe state a sub-group at a time,
// reading the next one while it steps this one and writing behind, so the drive never idles and
// the CPU AdamW (faster than the drive here) hides under its traffic; whole, one unit's read,
// AdamW and write follow each other.
TEST(PerfModel, SubGroupsOverlapTheAdamWWithTheDrive) {
  MachineProfile m = fast_machine();
  m.nvme_read_bps = m.nvme_write_bps = 1e9;
  m.cpu_adamw_params_per_s = 1e8;
  const std::uint64_t n = 16 * kLayer;  // one 32M-parameter layer
  const ModelProfile mp = synthetic(1, n, 0, 0);
  const double drive = 24.0 * double(n) / 1e9, adamw = double(n) / 1e8;  // 0.81 s, 0.34 s
  for (const bool early : {false, true}) {
    EngineConfig c = placed(Tier::kDevice, Tier::kNvme, Tier::kHost);
    c.overlap_optimizer = early;
    const Prediction whole = predict_step(m, mp, c);
    c.sub_group_size = n / 32;
    const Prediction split = predict_step(m, mp, c);
    EXPECT_NEAR(whole.step_s, drive + adamw, (drive + adamw) * 1e-2) << "early " << early;
    EXPECT_NEAR(split.step_s, drive, drive * 1e-3) << "early " << early;
    int reads = 0;
    for (const Interval& iv : split.schedule) reads += iv.what == "read state layers.0";
    EXPECT_EQ(reads, 32) << "early " << early;
  }
}

// MachineProfile::nvme_request_s: each sub-group's read of optimizer state pays the drive's fixed
// time of a read waited for alone on top of its bytes, so small sub-groups cost more than their
// bytes say (measured: 270 KB sub-groups took 0.25 ms each against 0.16 for their bytes).
TEST(PerfModel, EachSubGroupsReadPaysTheDrivesFixedTime) {
  MachineProfile m = fast_machine();
  m.nvme_read_bps = m.nvme_write_bps = 1e9;
  m.cpu_adamw_params_per_s = 1e8;
  m.nvme_request_s = 0.002;
  const std::uint64_t n = 16 * kLayer;  // one 32M-parameter layer
  const ModelProfile mp = synthetic(1, n, 0, 0);
  const double drive = 24.0 * double(n) / 1e9, adamw = double(n) / 1e8;  // 0.81 s, 0.34 s
  EngineConfig c = placed(Tier::kDevice, Tier::kNvme, Tier::kHost);
  c.overlap_optimizer = false;
  EXPECT_NEAR(predict_step(m, mp, c).step_s, drive + adamw + 0.002, (drive + adamw) * 1e-2);
  c.sub_group_size = n / 32;
  EXPECT_NEAR(predict_step(m, mp, c).step_s, drive + 32 * 0.002, drive * 1e-2);  // (was `drive`)
}

// MachineProfile::nvme_subgroup_s: measured as the optimizer's own loop (wait for a sub-group's
// read, read the next, write behind), a sub-group's time beyond its bytes is paid once, by its
// read of state; the writes behind it (state, new weights) overlap their per-request part with
// that wait and pay their bytes alone. Unmeasured, the read pays nvme_request_s and each write
// the mixed traffic's part.
TEST(PerfModel, TheOptimizersLoopPaysASubGroupsTimeOnce) {
  MachineProfile m = fast_machine();
  m.nvme_read_bps = m.nvme_write_bps = 1e9;
  m.nvme_request_s = 0.002;
  m.nvme_mixed_request_s = 0.001;
  const std::uint64_t n = 16 * kLayer;
  const ModelProfile mp = synthetic(1, n, 0, 0);
  MachineProfile bytes_only = m;
  bytes_only.nvme_request_s = bytes_only.nvme_mixed_request_s = 0;
  for (const Tier params : {Tier::kDevice, Tier::kNvme}) {
    EngineConfig c = placed(params, Tier::kNvme, Tier::kHost);
    c.optimizer_nvme_paths = c.param_nvme_paths = {"/tmp"};
    c.sub_group_size = n / 32;
    c.overlap_optimizer = false;  // one step replayed
    auto fixed_s = [&](const MachineProfile& mm, std::size_t& reads, std::size_t& writes) {
      const Prediction p = predict_step(mm, mp, c);
      reads = writes = 0;
      for (const Interval& iv : p.schedule) {
        reads += iv.what.starts_with("read state");
        writes += iv.what.starts_with("write state") || iv.what.starts_with("write w");
      }
      return p.busy_s[int(Resource::kNvme)] -
             predict_step(bytes_only, mp, c).busy_s[int(Resource::kNvme)];
    };
    std::size_t reads = 0, writes = 0;
    const double unmeasured = fixed_s(m, reads, writes);
    EXPECT_EQ(reads, 32u + 2) << "params " << tier_name(params);  // the layer's, embed, head
    EXPECT_EQ(writes, (params == Tier::kNvme ? 2 : 1) * reads) << "params " << tier_name(params);
    EXPECT_NEAR(unmeasured, 0.002 * double(reads) + 0.001 * double(writes), 1e-9);
    m.nvme_subgroup_s = 0.0015;
    EXPECT_NEAR(fixed_s(m, reads, writes), 0.0015 * double(reads), 1e-9)
        << "params " << tier_name(params);
    m.nvme_subgroup_s = -1;
  }
}

// MachineProfile::nvme_fetch_request_s: the engine reads a unit's NVMe weights one request a
// sub-group (at most aio.block_size each), so sub-groups smaller than a block make more requests
// than one read of the shard, and each one more adds its time to the fetch (measured on the demo
// model: 90 KB sub-groups read a 2.9 MB layer in 1.7 ms, where one read of it takes 0.7).
TEST(PerfModel, ASubGroupsWeightReadAddsItsRequestTime) {
  MachineProfile m = fast_machine();
  m.nvme_fetch_read_bps = 1e9;
  m.nvme_fetch_request_s = 0.001;
  const ModelProfile mp = synthetic(1, kLayer, 0, 0);  // 8 MiB a layer
  EngineConfig c = placed(Tier::kNvme, Tier::kHost, Tier::kHost);
  c.aio.block_size = std::size_t(1) << 20;
  auto read_s = [&](const EngineConfig& cfg) {
    const Prediction p = predict_step(m, mp, cfg);
    for (const Interval& iv : p.schedule)
      if (iv.what == "read w layers.0") return iv.end_s - iv.start_s;
    ADD_FAILURE() << "no NVMe read of layers.0";
    return 0.0;
  };
  const double bytes_s = 4.0 * double(kLayer) / 1e9;
  EXPECT_NEAR(read_s(c), bytes_s, bytes_s * kRel);  // one read: 8 requests of 1 MiB
  c.sub_group_size = kLayer / 4;                    // 4 of 2 MiB: the same 8 requests
  EXPECT_NEAR(read_s(c), bytes_s, bytes_s * kRel);
  c.sub_group_size = kLayer / 32;  // 32 of 256 KiB: 24 requests more
  EXPECT_NEAR(read_s(c), bytes_s + 24 * 0.001, bytes_s * kRel);
  m.nvme_fetch_request_s = 0;  // none measured: the bytes alone
  EXPECT_NEAR(read_s(c), bytes_s, bytes_s * kRel);
}

// NVMe optimizer state, several sub-groups a unit: the worker reads the first sub-group of the job
// it takes next while it steps the last one of the job before (EarlyStepper::read_ahead_next),
// choosing by the same rule as its next job — so the drive reads the jobs in the order the
// worker takes them, and no job after the first waits for its first read.
TEST(PerfModel, NvmeStateIsReadAheadForTheJobTheWorkerTakesNext) {
  MachineProfile m = fast_machine();
  m.cpu_adamw_params_per_s = double(kLayer) / 0.050;
  m.nvme_read_bps = m.nvme_write_bps =
      12.0 * double(kLayer / 4) / 0.004;  // a sub-group's state in 4 ms
  const ModelProfile mp = synthetic(4, kLayer, 0.010, 0.020);
  EngineConfig c = placed(Tier::kDevice, Tier::kNvme, Tier::kHost);
  c.sub_group_size = kLayer / 4;
  const Prediction p = predict_step(m, mp, c);
  // Each unit once for its run of sub-groups.
  auto runs = [](const std::string& order) {
    std::string out, last, unit;
    for (std::istringstream in(order); in >> unit; last = unit)
      if (unit != last) out += (out.empty() ? "" : " ") + unit;
    return out;
  };
  // The predicted step: the last step's layers 2, the embedding, layers 0 and 1 (the forward's
  // order, the first already running), then this step's head and layer 3; at layer 3's last
  // sub-group only layer 2's gradient is there, so its state is read ahead and it is taken next
  // although layer 1's is there when layer 3 ends.
  EXPECT_EQ(runs(units_by_start(p, "adamw ")),
            "layers.2 embed layers.0 layers.1 head layers.3 layers.2 embed");
  EXPECT_EQ(runs(units_by_start(p, "read state ")), runs(units_by_start(p, "adamw ")));
}

// strata.device_grad_norm: with one micro-batch a step the device sums the host-tier gradients'
// squares, and the host's pass over them (4 bytes a parameter at host_norm_bps) leaves the step.
TEST(PerfModel, TheDevicesNormTakesTheHostsPassOutOfTheStep) {
  MachineProfile m = fast_machine();
  m.host_norm_bps = 4e8;  // the host's norm pass: 4 * params / 4e8 s
  const ModelProfile mp = synthetic(4, kLayer, 0, 0);
  const double params = 4.0 * double(kLayer) + 2 * 2048;
  EngineConfig c = placed(Tier::kDevice, Tier::kHost, Tier::kHost);
  c.device_grad_norm = false;
  const Prediction host = predict_step(m, mp, c);
  EXPECT_NEAR(host.step_s, 4 * params / 4e8, 4 * params / 4e8 * kRel);
  c.device_grad_norm = true;
  const Prediction device = predict_step(m, mp, c);
  EXPECT_LT(device.step_s, host.step_s * 1e-3);
  for (const Interval& iv : device.schedule)
    EXPECT_EQ(iv.what.rfind("norm ", 0), std::string::npos) << iv.what;
  c.gradient_accumulation_steps = 2;  // the host accumulates: the host takes the norm again
  EXPECT_NEAR(predict_step(m, mp, c).step_s, 4 * params / 4e8, 4 * params / 4e8 * kRel);
}

TEST(PerfModel, MissingRateIsAnError) {
  MachineProfile m = fast_machine();
  m.nvme_read_bps = 0;
  const ModelProfile mp = synthetic(2, kLayer, 0, 0);
  try {
    predict_step(m, mp, placed(Tier::kDevice, Tier::kNvme, Tier::kHost));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("NVMe read"), std::string::npos) << e.what();
  }
}

// A profile without ranks or units is refused with the reason, before anything is laid out (a
// world size of 0 would divide by it).
TEST(PerfModel, AnEmptyWorldOrModelIsAnError) {
  MachineProfile m = fast_machine();
  const ModelProfile mp = synthetic(2, kLayer, 0, 0);
  const EngineConfig c = placed(Tier::kDevice, Tier::kDevice, Tier::kDevice);
  m.world_size = 0;
  try {
    predict_step(m, mp, c);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("world_size 0 must be at least 1"), std::string::npos)
        << e.what();
  }
  m.world_size = 1;
  try {
    predict_step(m, ModelProfile{}, c);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("has no units"), std::string::npos) << e.what();
  }
}

TEST(PerfModel, SearchRanksOnlyWhatFitsFastestFirst) {
  MachineProfile m = fast_machine();
  m.h2d_bps = m.d2h_bps = 10e9;
  m.nvme_read_bps = m.nvme_write_bps = 2e9;
  m.cpu_adamw_params_per_s = 5e8;
  m.device_capacity = 48 << 20;  // less than the fp32 weights + optimizer state (16 MiB x 4 layers)
  SearchSpace space;
  space.base = default_engine_config();
  space.nvme_paths = {"/tmp"};
  space.models.push_back(synthetic(4, kLayer, 0.002, 0.004));
  const SearchResult r = search_placements(m, space);
  ASSERT_FALSE(r.ranked.empty());
  EXPECT_GT(r.considered, r.ranked.size());  // some did not fit
  // NVMe placements are also tried with twice the swap buffers (and only those).
  int doubled = 0;
  for (const Candidate& c : r.ranked) {
    if (c.label.find("twice the swap buffers") == std::string::npos) continue;
    ++doubled;
    EXPECT_TRUE(c.config.params.nvme_fraction() > 0 || c.config.optimizer.nvme_fraction() > 0)
        << c.label;
    // Of what is on NVMe only (a doubled offload_param.buffer_count beside params on the device
    // read as a setting that did something).
    EXPECT_EQ(c.config.optimizer_buffer_count,
              (c.config.optimizer.nvme_fraction() > 0 ? 2 : 1) * space.base.optimizer_buffer_count)
        << c.label;
    EXPECT_EQ(c.config.param_buffer_count,
              (c.config.params.nvme_fraction() > 0 ? 2 : 1) * space.base.param_buffer_count)
        << c.label;
  }
  EXPECT_GT(doubled, 0);
  double fastest = 0;
  for (std::size_t i = 0; i < r.ranked.size(); ++i) {
    EXPECT_TRUE(r.ranked[i].plan.fits) << r.ranked[i].label;
    EXPECT_LE(r.ranked[i].plan.device_bytes, m.device_capacity) << r.ranked[i].label;
    fastest = std::max(fastest, r.ranked[i].prediction.tokens_per_s);
    // The recommended first (recommend_less_drive_bound), then fastest first.
    if (i > 1) {
      EXPECT_GE(r.ranked[i - 1].prediction.tokens_per_s, r.ranked[i].prediction.tokens_per_s);
    }
  }
  EXPECT_GE(r.ranked[0].prediction.tokens_per_s, (1 - kRecommendTieWithin) * fastest);
}

Candidate predicted(double tokens_per_s, double drive_busy_s) {
  Candidate c;
  c.label = fmt::format("{} tokens/s, drive {} s", tokens_per_s, drive_busy_s);
  c.prediction.tokens_per_s = tokens_per_s;
  c.prediction.busy_s[int(Resource::kNvme)] = drive_busy_s;
  return c;
}

std::vector<std::string> labels_of(const std::vector<Candidate>& ranked) {
  std::vector<std::string> l;
  for (const Candidate& c : ranked) l.push_back(c.label);
  return l;
}

// Of candidates predicted within 5% of the fastest, the fastest whose drive is busy for at most
// 80% of the fastest's drive time is recommended (moved first, the others in their order); a
// drive busy for more than that, a candidate beyond 5%, or no drive at all moves nothing.
TEST(PerfModel, TheRecommendationAmongNearTiesIsLessDriveBound) {
  std::vector<Candidate> r = {predicted(100, 0.010), predicted(99, 0.0085), predicted(97, 0.006),
                              predicted(96, 0.002),  predicted(94, 0),      predicted(90, 0.001)};
  const auto before = labels_of(r);
  recommend_less_drive_bound(r);
  EXPECT_EQ(labels_of(r), (std::vector<std::string>{before[2], before[0], before[1], before[3],
                                                    before[4], before[5]}));

  r = {predicted(100, 0.010), predicted(99, 0.0085), predicted(94, 0)};
  auto same = labels_of(r);
  recommend_less_drive_bound(r);
  EXPECT_EQ(labels_of(r), same) << "85% of the fastest's drive time is not markedly less, and 6% "
                                   "slower is not a near-tie";

  r = {predicted(100, 0), predicted(99.5, 0), predicted(99, 0)};
  same = labels_of(r);
  recommend_less_drive_bound(r);
  EXPECT_EQ(labels_of(r), same) << "no drive: the fastest stays first";

  r = {predicted(100, 0.002), predicted(99, 0.010)};
  same = labels_of(r);
  recommend_less_drive_bound(r);
  EXPECT_EQ(labels_of(r), same) << "the fastest is already the least drive-bound";

  r.clear();
  recommend_less_drive_bound(r);  // nothing to recommend: no error
  EXPECT_TRUE(r.empty());
}

// Optimizer state on NVMe and too little host memory for its swap buffers of a whole unit's
// state: the search tries smaller sub-groups (zero_optimization.sub_group_size), keeps the
// largest that fits, says so in the label and writes it in the config; with room to spare it
// leaves the config's.
TEST(PerfModel, SearchShrinksSubGroupsToFitTheHost) {
  MachineProfile m = fast_machine();
  m.h2d_bps = m.d2h_bps = 10e9;
  m.nvme_read_bps = m.nvme_write_bps = 2e9;
  m.cpu_adamw_params_per_s = 5e8;
  m.host_capacity = std::uint64_t(600) << 20;  // a 32M-element layer's state is 384 MiB a buffer
  SearchSpace space;
  space.base = default_engine_config();
  space.nvme_paths = {"/tmp"};
  space.models.push_back(synthetic(2, 16 * kLayer, 0.002, 0.004));
  const SearchResult r = search_placements(m, space);
  int split = 0;
  for (const Candidate& c : r.ranked) {
    EXPECT_LE(c.plan.host_bytes, m.host_capacity) << c.label;
    if (c.label.find("sub-groups of") == std::string::npos) {
      EXPECT_FALSE(c.config.sub_group_size_given) << c.label;
      continue;
    }
    ++split;
    EXPECT_GT(c.config.optimizer.nvme_fraction(), 0) << c.label;
    EXPECT_LT(c.config.sub_group_size, 16 * kLayer) << c.label;
    EXPECT_EQ(c.config.sub_group_size % 2048, 0u) << c.label;
    EXPECT_NE(c.label.find(fmt::format("sub-groups of {} elements", c.config.sub_group_size)),
              std::string::npos)
        << c.label;
    // The largest that fits: twice it does not.
    EngineConfig twice = c.config;
    twice.sub_group_size *= 2;
    PlanInputs in;
    for (const auto& x : space.models[0].units) in.units.push_back({x.name, x.numel});
    in.device_capacity = m.device_capacity;
    in.host_capacity = m.host_capacity;
    in.nvme_capacity = m.nvme_free;
    EXPECT_FALSE(plan_memory(twice, in).fits) << c.label;
    EXPECT_NE(engine_config_json(c.config).find(
                  fmt::format("\"sub_group_size\": {}", c.config.sub_group_size)),
              std::string::npos)
        << engine_config_json(c.config);
  }
  EXPECT_GT(split, 0);
  // Twice the optimizer's swap buffers of half the sub-group are the same bytes: not listed again
  // (with params on NVMe it is another candidate: their read-ahead doubles).
  for (const Candidate& c : r.ranked)
    EXPECT_FALSE(c.label.find("sub-groups of") != std::string::npos &&
                 c.label.find("twice the swap buffers") != std::string::npos &&
                 c.config.params.nvme_fraction() == 0)
        << c.label;
  m.host_capacity = std::uint64_t(64) << 30;
  for (const Candidate& c : search_placements(m, space).ranked)
    EXPECT_EQ(c.label.find("sub-groups of"), std::string::npos) << c.label;
}

// A window of K units holds K padded units (the engine's measure): with 2 ranks a 1000001-element
// layer pads to 1003520, and "2 units live" held one (never prefetching). Candidates that lay the
// state out alike are one: with every unit persistent, no weight tier or window to choose.
TEST(PerfModel, SearchWindowsArePaddedUnitsAndLayoutTwinsAreOne) {
  MachineProfile m = fast_machine();
  m.world_size = 2;
  m.all_gather_bps = m.reduce_scatter_bps = kFast;
  SearchSpace space;
  space.base = default_engine_config();
  space.models.push_back(synthetic(4, 1'000'001, 0.002, 0.004));
  SearchResult r = search_placements(m, space);
  int windows = 0;
  for (const Candidate& c : r.ranked) {
    if (c.label.find("2 units live") == std::string::npos) continue;
    ++windows;
    EXPECT_EQ(c.config.max_live_parameters, 2u * 1'003'520) << c.label;
    EXPECT_EQ(c.config.prefetch_bucket_size, 1'003'520u) << c.label;
  }
  EXPECT_GT(windows, 0);

  space.models = {synthetic(4, 4096, 0.002, 0.004)};  // every unit under the persistence threshold
  space.nvme_paths = {"/nvme"};  // NVMe offered: nothing of these units can be swapped there
  r = search_placements(m, space);
  ASSERT_FALSE(r.ranked.empty());
  std::set<std::string> labels;
  for (const Candidate& c : r.ranked) {
    EXPECT_NE(c.label.find("all units live"), std::string::npos)
        << "a window over resident units: " << c.label;
    EXPECT_EQ(c.label.find("params host"), std::string::npos)
        << "the same layout as params device: " << c.label;
    EXPECT_TRUE(labels.insert(c.label).second) << c.label;
    // "twice the swap buffers" of a layout with nothing on NVMe is the same candidate again
    // (it was listed, and validated, beside its twin).
    if (c.plan.nvme_bytes == 0) {
      EXPECT_EQ(c.label.find("twice the swap buffers"), std::string::npos) << c.label;
    }
  }
}

// A candidate keeping the layer checkpoints on the host plans their host RAM as strata-train's plan
// does (it was recommended where strata-train then refused the run for host RAM).
TEST(PerfModel, CheckpointsOnTheHostArePlannedInHostRam) {
  MachineProfile m = fast_machine();
  SearchSpace space;
  space.base = default_engine_config();
  ModelProfile on_host = synthetic(4, kLayer, 0.002, 0.004);
  on_host.checkpoint = on_host.checkpoint_on_host = true;
  on_host.host_checkpoint_bytes = std::uint64_t(1) << 30;
  space.models.push_back(on_host);
  SearchResult r = search_placements(m, space);
  ASSERT_FALSE(r.ranked.empty());
  for (const Candidate& c : r.ranked) {
    bool line = false;
    for (const PlanLine& l : c.plan.ram_lines)
      line = line || (l.what.find("layer checkpoints") != std::string::npos &&
                      l.bytes == std::uint64_t(1) << 30);
    EXPECT_TRUE(line) << c.label;
  }
  // RAM for all but the checkpoints: none fits, and the fix names the device's checkpointing.
  m.ram_capacity = r.ranked[0].plan.ram_bytes - (std::uint64_t(1) << 29);
  r = search_placements(m, space);
  EXPECT_TRUE(r.ranked.empty());
  ASSERT_FALSE(r.problems.empty());
  std::string all;
  for (const auto& p : r.problems) all += p + "\n";
  EXPECT_NE(all.find("--checkpoint-activations instead of --checkpoint-on-host"), std::string::npos)
      << all;
}

TEST(PerfModel, NothingFitsSaysWhatIsMissingWhere) {
  MachineProfile m = fast_machine();
  m.device_capacity = 1 << 20;
  m.host_capacity = 1 << 20;
  SearchSpace space;
  space.base = default_engine_config();
  space.models.push_back(synthetic(4, kLayer, 0.002, 0.004));
  const SearchResult r = search_placements(m, space);
  EXPECT_TRUE(r.ranked.empty());
  ASSERT_FALSE(r.problems.empty());
  std::string all;
  for (const auto& p : r.problems) all += p + "\n";
  EXPECT_NE(all.find("device"), std::string::npos) << all;
  EXPECT_NE(all.find("host"), std::string::npos) << all;
}

// Weights and gradients split between device and host (offload_param.ratio,
// offload_grads_ratio) are written so: engine_config_json refused them, and strata-prof's
// written config then silently dropped the user's own keys.
TEST(PerfModel, ConfigJsonWritesDeviceHostSplitsOfEveryPiece) {
  EngineConfig c = default_engine_config();
  c.params = Placement{0.4, 0.6};
  c.grads = Placement{0.25, 0.75};
  c.optimizer = Placement{0.5, 0.5};
  const std::string text = engine_config_json(c);
  const EngineConfig r = parse_engine_config(text, 1);
  SCOPED_TRACE(text);
  EXPECT_DOUBLE_EQ(r.params.device_fraction, 0.4);
  EXPECT_DOUBLE_EQ(r.params.host_fraction, 0.6);
  EXPECT_DOUBLE_EQ(r.grads.device_fraction, 0.25);
  EXPECT_DOUBLE_EQ(r.grads.host_fraction, 0.75);
  EXPECT_DOUBLE_EQ(r.optimizer.device_fraction, 0.5);
  EXPECT_DOUBLE_EQ(r.optimizer.host_fraction, 0.5);
}

TEST(PerfModel, ConfigJsonRoundTrips) {
  const char* const schedulers[] = {"", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"};
  int variant = 0;
  for (Tier pt : {Tier::kDevice, Tier::kHost, Tier::kNvme})
    for (Tier ot : {Tier::kDevice, Tier::kHost, Tier::kNvme})
      for (Tier gt : {Tier::kDevice, Tier::kHost, Tier::kNvme}) {
        if (gt == Tier::kNvme && pt != Tier::kNvme && ot != Tier::kNvme)
          continue;  // (no path for them)
        EngineConfig c = placed(pt, ot, gt);
        if (pt == Tier::kNvme) c.param_nvme_paths = {"/tmp/a"};
        if (ot == Tier::kNvme) {
          c.optimizer_nvme_paths = {"/tmp/a", "/tmp/b"};
          c.optimizer.host_fraction = 0.25;
        }
        if (gt ==
            Tier::kNvme) {  // beside the optimizer state, else the weights; a share on the host
          c.grad_nvme_paths = ot == Tier::kNvme ? c.optimizer_nvme_paths : c.param_nvme_paths;
          c.grads.host_fraction = 0.5;
        }
        c.compute_dtype = DType::kBF16;
        c.micro_batch_per_gpu = 3;
        c.gradient_accumulation_steps = 2;
        c.max_live_parameters = 123456;
        c.prefetch_bucket_size = 4096;
        c.gradient_clipping = 1.5;
        c.aio.block_size = 1 << 16;
        c.aio.queue_depth = 32;
        c.host_budget_bytes = 1 << 30;
        // What the search does not decide is written as the user gave it (it was dropped).
        c.adamw.bias_correction = variant % 2 == 0;
        c.gather_16bit_weights_on_model_save = variant % 2 == 1;
        c.device_grad_norm = variant % 3 == 0;
        c.optimizer_isa = variant % 2 == 0 ? Isa::kScalar : Isa::kAuto;
        c.decay_exempt_norms_and_biases = variant % 2 == 1;
        c.scheduler.type = schedulers[variant++ % 4];
        c.scheduler.warmup_num_steps = 7;
        c.scheduler.total_num_steps = 70;
        c.scheduler.warmup_type = "linear";
        c.scheduler.warmup_min_lr = 1e-5;
        c.scheduler.warmup_max_lr = c.scheduler.type == "WarmupLR" ? -1 : 3e-3;
        c.scheduler.cos_min_ratio = 0.01;
        c.scheduler.warmup_min_ratio = 0.1;
        const std::string text = engine_config_json(c);
        const EngineConfig r = parse_engine_config(text, 1);
        SCOPED_TRACE(text);
        EXPECT_EQ(r.params.device_fraction, c.params.device_fraction);
        EXPECT_EQ(r.params.host_fraction, c.params.host_fraction);
        EXPECT_EQ(r.optimizer.device_fraction, c.optimizer.device_fraction);
        EXPECT_EQ(r.optimizer.host_fraction, c.optimizer.host_fraction);
        EXPECT_EQ(r.grads.device_fraction, c.grads.device_fraction);
        EXPECT_EQ(r.grads.host_fraction, c.grads.host_fraction);
        EXPECT_EQ(r.grad_nvme_paths, c.grad_nvme_paths);
        EXPECT_EQ(r.param_nvme_paths, c.param_nvme_paths);
        EXPECT_EQ(r.optimizer_nvme_paths, c.optimizer_nvme_paths);
        EXPECT_EQ(r.compute_dtype, DType::kBF16);
        EXPECT_EQ(r.micro_batch_per_gpu, 3);
        EXPECT_EQ(r.gradient_accumulation_steps, 2);
        EXPECT_EQ(r.max_live_parameters, 123456u);
        EXPECT_EQ(r.prefetch_bucket_size, 4096u);
        EXPECT_EQ(r.param_persistence_threshold, 0u);
        EXPECT_EQ(r.gradient_clipping, 1.5);
        EXPECT_EQ(r.aio.block_size, std::size_t(1) << 16);
        EXPECT_EQ(r.aio.queue_depth, 32);
        EXPECT_EQ(r.host_budget_bytes, std::uint64_t(1) << 30);
        EXPECT_EQ(r.adamw.lr, c.adamw.lr);
        EXPECT_EQ(r.adamw.beta1, c.adamw.beta1);
        EXPECT_EQ(r.adamw.beta2, c.adamw.beta2);
        EXPECT_EQ(r.adamw.eps, c.adamw.eps);
        EXPECT_EQ(r.adamw.bias_correction, c.adamw.bias_correction);
        EXPECT_EQ(r.gather_16bit_weights_on_model_save, c.gather_16bit_weights_on_model_save);
        EXPECT_EQ(r.device_grad_norm, c.device_grad_norm);
        EXPECT_EQ(r.optimizer_isa, c.optimizer_isa);
        EXPECT_EQ(r.decay_exempt_norms_and_biases, c.decay_exempt_norms_and_biases);
        EXPECT_EQ(r.scheduler.type, c.scheduler.type);
        if (!c.scheduler.type.empty()) {
          EXPECT_EQ(r.scheduler.warmup_num_steps, 7);
          EXPECT_EQ(r.scheduler.warmup_type, "linear");
          for (std::int64_t t : {1, 2, 8, 40, 70, 90})  // the same lr at every step
            EXPECT_EQ(scheduled_lr(r.scheduler, r.adamw.lr, t),
                      scheduled_lr(c.scheduler, c.adamw.lr, t))
                << t;
        }
        EXPECT_EQ(text.find("max_in_cpu"), std::string::npos) << "a key strata-train warns about";
        // Its default, false, is not written: strata-train warns of a false one on every run.
        EXPECT_EQ(text.find("gather_16bit") != std::string::npos,
                  c.gather_16bit_weights_on_model_save)
            << text;
        // Floats written as the decimals that read back as them, not their double expansion.
        EXPECT_EQ(text.find("0.89999997"), std::string::npos) << text;
        EXPECT_NE(text.find("0.999\n"), std::string::npos) << text;
      }
}

#if defined(STRATA_PROF_BIN) && defined(STRATA_TRAIN_BIN)
// A small Llama: the whole strata-prof run takes seconds.
std::string tiny_model(const std::string& dir) {
  const std::string path = dir + "/config.json";
  std::ofstream(path) << nlohmann::json{
      {"model_type", "llama"},
      {"architectures", {"LlamaForCausalLM"}},
      {"vocab_size", 256},
      {"hidden_size", 64},
      {"intermediate_size", 160},
      {"num_hidden_layers", 3},
      {"num_attention_heads", 4},
      {"num_key_value_heads", 2},
      {"max_position_embeddings", 128},
      {"rms_norm_eps", 1e-5},
      {"tie_word_embeddings",
       false}}.dump();
  return path;
}

// strata-prof on the tiny model in a 20 MiB device with a drive (`dir`/nvme, made here), the
// recommendation to `dir`/best.json, and `more`.
std::vector<std::string> tiny_with_drive(const std::string& model, const std::string& dir,
                                         const std::vector<std::string>& more) {
  fs::create_directories(dir + "/nvme");
  std::vector<std::string> args = {"--model-config",  model,
                                   "--device",        "cpu",
                                   "--device-mem-gb", "0.02",
                                   "--seq-len",       "32",
                                   "--micro-batches", "2",
                                   "--nvme-path",     dir + "/nvme",
                                   "--out",           dir + "/best.json"};
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

TEST(ProfCli, RecommendationIsAcceptedByStrataTrainAndFits) {
  TempDir d("strata-prof");
  const std::string model = tiny_model(d.path);
  const auto r = testing::run(
      STRATA_PROF_BIN,
      tiny_with_drive(model, d.path,
                      {"--svg", d.path + "/prof.svg", "--validate", "1", "--validate-steps", "2",
                       "--trace", d.path + "/trace.json", "--json"}),
      d.path, "prof");
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  // The last line is the JSON summary.
  const std::string last = r.out.substr(r.out.rfind('\n', r.out.size() - 2) + 1);
  const auto j = nlohmann::json::parse(last);
  EXPECT_TRUE(j["fits"].get<bool>());
  EXPECT_GT(j["candidates_feasible"].get<int>(), 0);
  EXPECT_GT(j["candidates"][0]["measured_step_s"].get<double>(), 0);
  // The candidate predicted fastest: #1, or another the recommendation among near-ties passed
  // over, which the output names.
  const int fastest = j["fastest_predicted_rank"].get<int>();
  EXPECT_GE(fastest, 1);
  EXPECT_LE(fastest, j["candidates_feasible"].get<int>());
  EXPECT_EQ(r.out.find(fmt::format("#1 is recommended over #{}, predicted", fastest)) !=
                std::string::npos,
            fastest > 1)
      << r.out;
  EXPECT_GT(j["machine"]["nvme_read_gbps"].get<double>(), 0);
  // The CPU AdamW as the engine calls it: a rate and a fixed time a call.
  EXPECT_GT(j["machine"]["cpu_adamw_mparams_per_s"].get<double>(), 0);
  EXPECT_GE(j["machine"]["cpu_adamw_call_ms"].get<double>(), 0);
  EXPECT_NE(r.out.find("a call (out of the cache)"), std::string::npos) << r.out;
  // The drive's sustained rate was measured (--nvme-sustain-s, 8 s by default), and the mixed rate
  // the model uses is no more than it or the short runs' rate.
  const auto& mj = j["machine"];
  EXPECT_GT(mj["nvme_sustained_gbps"].get<double>(), 0);
  EXPECT_LE(
      mj["nvme_mixed_gbps"].get<double>(),
      std::max(mj["nvme_sustained_gbps"].get<double>(), mj["nvme_mixed_burst_gbps"].get<double>()) *
          (1 + 1e-9));
  EXPECT_NE(r.out.find("nvme sustained (both at once"), std::string::npos) << r.out;
  // The kernels were timed beside the drive's traffic as well (a slowdown of 0 or more).
  EXPECT_GT(j["machine"]["nvme_load_gbps"].get<double>(), 0);
  EXPECT_GE(j["machine"]["nvme_compute_slowdown"].get<double>(), 0);
  EXPECT_NE(r.out.find("with the drive busy beside them"), std::string::npos) << r.out;
  // ... and each round's slowdown alone is shown beside it: how far one measurement moves.
  ASSERT_EQ(j["machine"]["nvme_compute_slowdown_rounds"].size(), 3u) << j["machine"].dump();
  for (const auto& x : j["machine"]["nvme_compute_slowdown_rounds"]) EXPECT_GE(x.get<double>(), 0);
  EXPECT_NE(r.out.find("longer (its rounds alone: "), std::string::npos) << r.out;
  // The drive's probe, as the profile took it and beside the validation runs (before each of the 2
  // rounds and after the last), where a validated candidate keeps bytes on NVMe (the spread runs
  // the last-ranked, which here does); the profile's over their median; the note that the drive
  // was profiled at another speed exactly when the profile's lies more than a tenth outside them.
  bool on_drive = false;
  for (const auto& c : j["candidates"])
    on_drive = on_drive || (c.contains("validated_as") && c["nvme_bytes"].get<double>() > 0);
  ASSERT_TRUE(on_drive) << "no validated candidate on the drive: " << r.out;
  const double probe = mj["drive_probe_gbps"].get<double>();
  EXPECT_GT(probe, 0);
  const std::vector<double> drive = j["validation_drive_gbps"].get<std::vector<double>>();
  ASSERT_EQ(drive.size(), 3u) << j.dump();
  for (double g : drive) EXPECT_GT(g, 0);
  std::vector<double> sorted_drive = drive;
  std::sort(sorted_drive.begin(), sorted_drive.end());
  EXPECT_NEAR(j["drive_profile_vs_validation"].get<double>(), probe / sorted_drive[1], 1e-9);
  const std::string drive_line = fmt::format(
      "the drive while validating {:.2f}-{:.2f} GB/s (3 checks at the same times: the engine's "
      "mix of reads and writes, probed as the profile did), the profile's {:.2f} GB/s",
      sorted_drive[0], sorted_drive[2], probe);
  EXPECT_NE(r.out.find(drive_line), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find(drive_line + ": outside that range") != std::string::npos,
            probe < 0.9 * sorted_drive[0] || probe > 1.1 * sorted_drive[2])
      << r.out;
  EXPECT_TRUE(fs::file_size(d.path + "/prof.svg") > 1000);
  EXPECT_TRUE(fs::file_size(d.path + "/trace.json") > 100);
  EXPECT_NE(testing::slurp(d.path + "/prof.svg").find("predicted step"), std::string::npos);
  // strata-train takes the file as it is, and its planner agrees that it fits.
  const auto plan =
      testing::run(STRATA_TRAIN_BIN,
                   {"--model-config", model, "--config", d.path + "/best.json", "--device", "cpu",
                    "--device-mem-gb", "0.02", "--seq-len", "32", "--plan"},
                   d.path, "plan");
  ASSERT_EQ(plan.status, 0) << plan.out << plan.err;
  EXPECT_EQ(plan.out.find("does not fit"), std::string::npos) << plan.out;
  // ... and trains with it.
  std::ofstream(d.path + "/text.txt")
      << std::string(20000, 'a') + "the quick brown fox jumps over the lazy dog\n";
  const auto train =
      testing::run(STRATA_TRAIN_BIN,
                   {"--model-config", model, "--config", d.path + "/best.json", "--device", "cpu",
                    "--device-mem-gb", "0.02", "--seq-len", "32", "--text", d.path + "/text.txt",
                    "--steps", "2", "--log-json", d.path + "/log.json"},
                   d.path, "train");
  ASSERT_EQ(train.status, 0) << train.out << train.err;
  EXPECT_NE(testing::slurp(d.path + "/log.json").find("\"step\":2"), std::string::npos);
}

// A drive measured but no validated candidate on it: the profile's probe is given, and nothing
// is probed beside the runs (they do not wait on the drive).
TEST(ProfCli, TheDriveIsCheckedOnlyBesideRunsThatUseIt) {
  TempDir d("strata-prof");
  const auto r = testing::run(
      STRATA_PROF_BIN,
      tiny_with_drive(tiny_model(d.path), d.path,
                      {"--nvme-sustain-s", "0", "--svg", "", "--validate", "1", "--validate-spread",
                       "0", "--validate-steps", "2", "--trace", "", "--json"}),
      d.path, "prof");
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  const auto j = nlohmann::json::parse(r.out.substr(r.out.rfind('\n', r.out.size() - 2) + 1));
  ASSERT_EQ(j["validated"].get<int>(), 1);
  ASSERT_EQ(j["candidates"][0]["nvme_bytes"].get<double>(), 0)
      << "the recommendation keeps bytes on the drive: " << r.out;
  EXPECT_GT(j["machine"]["drive_probe_gbps"].get<double>(), 0);
  EXPECT_TRUE(j["validation_drive_gbps"].empty()) << j.dump();
  EXPECT_TRUE(j["drive_profile_vs_validation"].is_null()) << j.dump();
  EXPECT_EQ(r.out.find("the drive while validating"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("the drive's check"), std::string::npos) << r.out;
  EXPECT_EQ(j["validation_host_mem_gbps"].size(), 3u) << j.dump();  // (the host's still is)
}

// A --config schedule sized for the whole run (total_num_steps "auto", a warmup longer than the
// steps measured) does not stop the validation runs (each failed: "auto" is the run's 2 steps,
// below the warmup), and the written file keeps it as given.
// ... and the line printed to run the recommendation carries the data the validation read (it was
// left out: run as printed, strata-train trained on the demo's text).
TEST(ProfCli, ValidationRunsDoNotTakeTheRunsSchedule) {
  TempDir d("strata-prof");
  const std::string model = tiny_model(d.path), ds = d.path + "/ds.json",
                    text = d.path + "/text.txt";
  {
    std::ofstream t(text);
    for (int i = 0; i < 400; ++i) t << "the quick brown fox jumps over the lazy dog " << i << "\n";
  }
  std::ofstream(ds)
      << R"({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 100,
    "total_num_steps": "auto"}}, "zero_optimization": {"stage": 3}})";
  // Work folders in $TMPDIR (--no-nvme) that runs interrupted while validating left: a dead one's
  // is removed (its lock free), a live one's (its lock held here) kept, another host's kept.
  char host[256] = {};
  ASSERT_EQ(::gethostname(host, sizeof host - 1), 0);
  const std::string tmp = d.path + "/tmp", dead = fmt::format("{}/prof-work-{}-1", tmp, host),
                    live = fmt::format("{}/prof-work-{}-2", tmp, host),
                    other = tmp + "/prof-work-another-host-3";
  for (const std::string& w : {dead, live, other}) {
    fs::create_directories(w);
    std::ofstream(w + "/.lock") << "";
    std::ofstream(w + "/tokens.u32") << "left";
  }
  const int held = ::open((live + "/.lock").c_str(), O_RDWR);
  ASSERT_GE(held, 0);
  ASSERT_EQ(::flock(held, LOCK_EX), 0);
  const auto r = testing::run(STRATA_PROF_BIN,
                              {"--model-config",
                               model,
                               "--config",
                               ds,
                               "--device",
                               "cpu",
                               "--seq-len",
                               "32",
                               "--micro-batches",
                               "2",
                               "--no-nvme",
                               "--out",
                               d.path + "/best.json",
                               "--svg",
                               "",
                               "--validate",
                               "1",
                               "--validate-steps",
                               "2",
                               "--top",
                               "1",
                               "--trace",
                               "",
                               "--text",
                               text,
                               "--json"},
                              d.path, "prof", {{"TMPDIR", tmp}});
  ::close(held);
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_FALSE(fs::exists(dead));
  EXPECT_TRUE(fs::exists(live + "/tokens.u32"));
  EXPECT_TRUE(fs::exists(other + "/tokens.u32"));
  std::size_t work_folders = 0;  // its own removed at its end
  for (const auto& e : fs::directory_iterator(tmp))
    work_folders += e.path().filename().string().starts_with("prof-work-");
  EXPECT_EQ(work_folders, 2u);
  const auto j = nlohmann::json::parse(r.out.substr(r.out.rfind('\n', r.out.size() - 2) + 1));
  EXPECT_GT(j["candidates"][0]["measured_step_s"].get<double>(), 0) << r.out;
  EXPECT_NE(r.out.find(" --text " + text + " --config " + d.path + "/best.json"), std::string::npos)
      << r.out;
  const auto best = nlohmann::json::parse(testing::slurp(d.path + "/best.json"));
  EXPECT_EQ(best["scheduler"]["params"]["total_num_steps"], "auto") << best.dump();
  EXPECT_EQ(best["scheduler"]["params"]["warmup_num_steps"], 100) << best.dump();
}

// Validated candidates of different micro-batch sizes are compared by tokens a second, as the
// search ranks them: the recommended B=8 measured 317 ms against 182 ms for a B=4 one and was
// said to be "73.9% slower than #3", while it trained 15% faster.
TEST(ProfCli, TheValidatedAreComparedByTokensASecond) {
  TempDir d("strata-prof");
  const std::string model = tiny_model(d.path);
  const auto r = testing::run(STRATA_PROF_BIN,
                              {"--model-config",
                               model,
                               "--device",
                               "cpu",
                               "--seq-len",
                               "32",
                               "--micro-batches",
                               "6",
                               "8",
                               "--no-nvme",
                               "--out",
                               d.path + "/best.json",
                               "--svg",
                               "",
                               "--validate",
                               "5",
                               "--validate-steps",
                               "2",
                               "--top",
                               "1",
                               "--trace",
                               "",
                               "--json"},
                              d.path, "prof");
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  const auto j = nlohmann::json::parse(r.out.substr(r.out.rfind('\n', r.out.size() - 2) + 1));
  std::set<std::string> batches;
  double best = 0;
  for (int i = 0; i < j["validated"].get<int>(); ++i) {
    const auto& c = j["candidates"][std::size_t(i)];
    // Every validated one has its figures, also past --top (they were bare measurements).
    ASSERT_TRUE(c.contains("label") && c.contains("predicted_step_s") && c.contains("micro_batch"))
        << c.dump();
    const double tokens_a_step =
        c["predicted_tokens_per_s"].get<double>() * c["predicted_step_s"].get<double>();
    const double tps = c["measured_tokens_per_s"].get<double>();
    EXPECT_NEAR(tps, tokens_a_step / c["measured_step_s"].get<double>(), tps * 1e-9) << c.dump();
    best = std::max(best, tps);
    const std::string label = c["label"];
    batches.insert(label.substr(label.rfind("B=")));
  }
  const double first = j["candidates"][0]["measured_tokens_per_s"].get<double>();
  EXPECT_NEAR(j["recommended_vs_best_measured"].get<double>(), best / first, 1e-9);
  EXPECT_NE(r.out.find(fmt::format("({:.0f} tokens/s)", first)), std::string::npos) << r.out;
  // ... and whether the runs could tell the two apart: the fastest's lead within their median
  // step-to-step spread (a tie, as the resolved rank correlation has it), said beside a miss.
  const double lead = best / first - 1, resolution = j["rank_tie_resolution"].get<double>();
  EXPECT_EQ(j["recommended_vs_best_within_spread"].get<bool>(), lead <= resolution) << j.dump();
  EXPECT_EQ(r.out.find("a tie they cannot order") != std::string::npos,
            lead > 0.05 && lead <= resolution)
      << r.out;
  EXPECT_TRUE(j["trace_file"].is_null()) << "--trace \"\" is no trace: " << j["trace_file"];
  if (batches.size() < 2)
    std::printf("(the 5 validated have one micro-batch size: %s)\n", batches.begin()->c_str());
  // The docs' table of prof-regimes runs reads this JSON: one row per regime, here the same run
  // in each regime's place.
  const std::string runs = d.path + "/regimes";
  std::filesystem::create_directories(runs);
  for (const char* regime : {"compute", "link", "nvme", "offload"})
    std::ofstream(runs + "/" + regime + ".json") << j.dump() << "\n";
  // (the nvme regime's recommendation as if taken over the fastest prediction, ranked third)
  nlohmann::json over = j;
  over["fastest_predicted_rank"] = 3;
  over["drive_profile_vs_validation"] = 1.25;  // (and its drive checked beside the runs)
  std::ofstream(runs + "/nvme.json") << over.dump() << "\n";
  const auto t =
      testing::run("/usr/bin/python3", {STRATA_SOURCE_DIR "/scripts/prof-regimes-table.py", runs},
                   d.path, "table");
  ASSERT_EQ(t.status, 0) << t.out << t.err;
  const auto& c0 = j["candidates"][0];
  EXPECT_NE(
      t.out.find(fmt::format(
          "| nvme | {} / {} | {:.1f} | {:.1f} | {:.1f}% of {} |",
          c0["bottleneck"].get<std::string>(),
          c0.value("measured_bottleneck", nlohmann::json("-")).is_string()
              ? c0["measured_bottleneck"].get<std::string>()
              : std::string("-"),
          c0["predicted_step_s"].get<double>() * 1e3, c0["measured_step_s"].get<double>() * 1e3,
          j["worst_prediction_error"].get<double>() * 100, j["validated"].get<int>())),
      std::string::npos)
      << t.out;
  EXPECT_NE(t.out.find(fmt::format("{} fit) |", j["candidates_feasible"].get<int>())),
            std::string::npos)
      << t.out;
  EXPECT_NE(t.out.find("(over #3) |"), std::string::npos) << t.out;
  EXPECT_EQ(t.out.find("(over #"), t.out.rfind("(over #")) << "only the nvme regime's: " << t.out;
  // and below it, the host's memory rate as profiled over its median beside the runs.
  const double speed = j["host_mem_profile_vs_validation"].get<double>();
  EXPECT_NE(t.out.find(fmt::format("host memory profiled / validating: compute {0:.2f}, link "
                                   "{0:.2f}, nvme {0:.2f}, offload {0:.2f}",
                                   speed)),
            std::string::npos)
      << t.out;
  // ... and the drive's probe likewise, where it was checked ("-" where not: --no-nvme here).
  EXPECT_NE(t.out.find("drive profiled / validating: compute -, link -, nvme 1.25, offload -"),
            std::string::npos)
      << t.out;
  // ... and the kernels' timing (checked in every regime here: the CPU-emulated device).
  EXPECT_NE(t.out.find(fmt::format("kernels profiled / validating: compute {0:.2f}, link {0:.2f}, "
                                   "nvme {0:.2f}, offload {0:.2f}",
                                   j["compute_profile_vs_validation"].get<double>())),
            std::string::npos)
      << t.out;
}

// --validate K's spread: beside the best K, the best of other placement classes and low-ranked
// ones, each saying why it ran and what bound its traced step; the summary is over all of them.
TEST(ProfCli, TheSpreadRunsOtherClassesAndTheLowRanked) {
  TempDir d("strata-prof");
  const std::vector<std::string> args = {"--model-config",
                                         tiny_model(d.path),
                                         "--device",
                                         "cpu",
                                         "--seq-len",
                                         "32",
                                         "--no-nvme",
                                         "--micro-batches",
                                         "2",
                                         "--out",
                                         d.path + "/best.json",
                                         "--svg",
                                         "",
                                         "--top",
                                         "1",
                                         "--validate",
                                         "1",
                                         "--validate-spread",
                                         "4",
                                         "--validate-steps",
                                         "2",
                                         "--trace",
                                         d.path + "/trace.json",
                                         "--json"};
  const auto r = testing::run(STRATA_PROF_BIN, args, d.path, "prof");
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  const auto j = nlohmann::json::parse(r.out.substr(r.out.rfind('\n', r.out.size() - 2) + 1));
  const int feasible = j["candidates_feasible"].get<int>();
  ASSERT_GE(feasible, 4) << "too few candidates for a spread";
  EXPECT_EQ(j["validated_top"].get<int>(), 1);
  std::set<std::string> classes;
  std::map<std::string, int> reasons;
  int validated = 0, last_rank = 0;
  for (const auto& c : j["candidates"]) {
    EXPECT_GT(c["rank"].get<int>(), last_rank) << "in rank order, once each";
    last_rank = c["rank"].get<int>();
    if (!c.contains("validated_as")) continue;
    ++validated;
    const std::string why = c["validated_as"], cls = c["placement_class"];
    ++reasons[why];
    SCOPED_TRACE(c.dump());
    if (why == "top") {
      EXPECT_EQ(c["rank"].get<int>(), 1);
    } else if (why == "best of class") {
      EXPECT_FALSE(classes.contains(cls)) << "a class already run";
    } else if (why == "low-ranked (last)") {
      EXPECT_EQ(c["rank"].get<int>(), feasible);
    }
    if (why == "top" || why == "best of class") classes.insert(cls);
    // The measured bottleneck is the lane busiest in the run's traced step.
    const std::string bound = c["measured_bottleneck"];
    double most = 0;
    for (const auto& [lane, s] : c["measured_busy_s"].items())
      most = std::max(most, s.get<double>());
    EXPECT_GT(most, 0);
    EXPECT_EQ(c["measured_busy_s"][bound].get<double>(), most);
  }
  EXPECT_EQ(validated, j["validated"].get<int>());
  EXPECT_LE(validated, 1 + 4);
  EXPECT_EQ(reasons["top"], 1);
  EXPECT_EQ(reasons["low-ranked (median)"], 1);
  EXPECT_EQ(reasons["low-ranked (last)"], 1);
  EXPECT_GE(reasons["best of class"], 1) << "the tiny model has more than one class that fits";
  // Spearman over every run, top or spread (the summary's).
  EXPECT_TRUE(j["rank_correlation_spearman"].is_number()) << j.dump();
  // What the predictions were held to, and how it was measured.
  EXPECT_NE(j["reference"].get<std::string>().find("median of all its timed steps"),
            std::string::npos)
      << j.dump();
  // and with the runs' own resolution: their median step-to-step spread, in [0, 1).
  ASSERT_TRUE(j["rank_tie_resolution"].is_number()) << j.dump();
  EXPECT_GE(j["rank_tie_resolution"].get<double>(), 0);
  EXPECT_LT(j["rank_tie_resolution"].get<double>(), 1);
  EXPECT_TRUE(j["rank_correlation_spearman_resolved"].is_number() ||
              j["rank_correlation_spearman_resolved"].is_null())
      << j.dump();
  EXPECT_NE(r.out.find("(the runs' step-to-step spread) as ties"), std::string::npos) << r.out;
  // No drive (--no-nvme): none probed, none checked beside the runs.
  EXPECT_TRUE(j["machine"]["drive_probe_gbps"].is_null()) << j["machine"].dump();
  EXPECT_TRUE(j["validation_drive_gbps"].empty()) << j.dump();
  EXPECT_TRUE(j["drive_profile_vs_validation"].is_null()) << j.dump();
  EXPECT_EQ(r.out.find("the drive while validating"), std::string::npos) << r.out;
  // Two rounds by default (validation_order): each validated one ran twice, its measured step the
  // median over both runs' timed steps (one each: --validate-steps 2 times the first step).
  EXPECT_EQ(j["validate_rounds"].get<int>(), 2);
  for (const auto& c : j["candidates"]) {
    if (!c.contains("validated_as")) continue;
    SCOPED_TRACE(c.dump());
    ASSERT_EQ(c["measured_round_step_s"].size(), 2u);
    const std::vector<double> steps = c["measured_steps_s"].get<std::vector<double>>();
    ASSERT_EQ(steps.size(), 2u);
    // median() takes the upper middle: the larger of two.
    EXPECT_DOUBLE_EQ(c["measured_step_s"].get<double>(), std::max(steps[0], steps[1]));
    std::vector<double> rounds = c["measured_round_step_s"].get<std::vector<double>>();
    std::sort(rounds.begin(), rounds.end());
    std::vector<double> sorted = steps;
    std::sort(sorted.begin(), sorted.end());
    EXPECT_EQ(rounds, sorted) << "a round's step is the median of its own timed steps";
  }
  // The rounds' drift: the largest over the validated candidates, named in the output when it is
  // as large as the error target.
  double drift = 0;
  for (const auto& c : j["candidates"])
    if (c.contains("validated_as"))
      drift = std::max(drift, round_drift(c["measured_round_step_s"].get<std::vector<double>>()));
  ASSERT_TRUE(j["round_drift"].is_number()) << j.dump();
  EXPECT_DOUBLE_EQ(j["round_drift"].get<double>(), drift);
  EXPECT_EQ(r.out.find("the machine drifted") != std::string::npos, drift >= 0.15) << r.out;
  // The host's memory rate beside the runs: before each of the 2 rounds and after the last, and
  // the profile's over their median; the note that the machine was profiled at another speed
  // exactly when the profile's lies more than a tenth outside their range.
  ASSERT_TRUE(j["validation_host_mem_gbps"].is_array()) << j.dump();
  const std::vector<double> checks = j["validation_host_mem_gbps"].get<std::vector<double>>();
  ASSERT_EQ(checks.size(), 3u);
  for (double c : checks) EXPECT_GT(c, 0);
  const double profile_mem = j["machine"]["host_mem_gbps"].get<double>();
  std::vector<double> sorted_checks = checks;
  std::sort(sorted_checks.begin(), sorted_checks.end());
  EXPECT_NEAR(j["host_mem_profile_vs_validation"].get<double>(), profile_mem / sorted_checks[1],
              1e-9);
  EXPECT_NE(r.out.find(fmt::format("host memory while validating {:.1f}-{:.1f} GB/s (3 checks: "
                                   "before each round and after the last), the profile's {:.1f} "
                                   "GB/s",
                                   sorted_checks.front(), sorted_checks.back(), profile_mem)),
            std::string::npos)
      << r.out;
  const bool another_speed =
      profile_mem < 0.9 * sorted_checks.front() || profile_mem > 1.1 * sorted_checks.back();
  EXPECT_EQ(
      r.out.find("the machine ran at another speed while it was profiled") != std::string::npos,
      another_speed)
      << r.out;
  // The kernels likewise, with or without a drive: the profile's timing of its first 2-layer copy
  // (the layer's forward and backward of the first profile in the model's table), timed again at
  // the same times; the ratio is of speeds, the profile's over the checks' median.
  const double probe_ms = j["machine"]["compute_probe_layer_ms"].get<double>();
  const auto& first_profile = j["model"]["measured"][0];
  EXPECT_NEAR(probe_ms,
              (first_profile["layer_forward_s"].get<double>() +
               first_profile["layer_backward_s"].get<double>()) *
                  1e3,
              1e-9);
  ASSERT_TRUE(j["validation_compute_layer_ms"].is_array()) << j.dump();
  std::vector<double> layer_ms = j["validation_compute_layer_ms"].get<std::vector<double>>();
  ASSERT_EQ(layer_ms.size(), 3u) << j.dump();
  for (double t : layer_ms) EXPECT_GT(t, 0);
  std::sort(layer_ms.begin(), layer_ms.end());
  EXPECT_NEAR(j["compute_profile_vs_validation"].get<double>(), layer_ms[1] / probe_ms, 1e-9);
  const std::string layer_line = fmt::format(
      "a layer's forward and backward while validating {:.2f}-{:.2f} ms (3 checks at the same "
      "times: the profile's 2-layer copy on a device of its own, timed as it was), the profile's "
      "{:.2f} ms",
      layer_ms.front(), layer_ms.back(), probe_ms);
  EXPECT_NE(r.out.find(layer_line), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find(layer_line + ": outside that range") != std::string::npos,
            probe_ms > layer_ms.back() / 0.9 || probe_ms < layer_ms.front() / 1.1)
      << r.out;
  EXPECT_EQ(r.out.find("the kernels' check"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("2 rounds in turns, each begun further along the order"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("round 1 of 2 done"), std::string::npos) << r.out;
  // The engine's note that the early step is off (host optimizer state), once for all the runs,
  // not between every two rows of the table.
  std::size_t notes = 0;
  for (std::size_t at = r.err.find("early optimizer step is off"); at != std::string::npos;
       at = r.err.find("early optimizer step is off", at + 1))
    ++notes;
  EXPECT_LE(notes, 1u) << r.err;
  EXPECT_NE(r.out.find(fmt::format("over {} runs", validated)), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("chosen as"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("low-ranked (last)"), std::string::npos) << r.out;
  EXPECT_EQ(j["trace_file"], d.path + "/trace.json");
}

// The --config's micro-batch is what the search centres on (B/2, B, 2B), as its dtype and
// accumulation are the defaults of --dtype and --grad-accum (it searched 1 and 2 and wrote
// B=1 over a train_batch_size of 16); a recommendation that changes the global batch says so
// and how to keep it. A repeated --micro-batches value is measured once.
TEST(ProfCli, TheConfigsBatchIsWhereTheSearchStarts) {
  TempDir d("strata-prof");
  const std::string model = tiny_model(d.path);
  std::ofstream(d.path + "/user.json")
      << R"({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2,
          "zero_optimization": {"stage": 3}})";
  const auto r = testing::run(
      STRATA_PROF_BIN,
      {"--model-config", model, "--config", d.path + "/user.json", "--device", "cpu", "--seq-len",
       "32", "--no-nvme", "--out", d.path + "/best.json", "--svg", "", "--json"},
      d.path, "prof");
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  const auto j = nlohmann::json::parse(r.out.substr(r.out.rfind('\n', r.out.size() - 2) + 1));
  std::set<std::int64_t> searched;
  for (const auto& c : j["candidates"]) searched.insert(c["micro_batch"].get<std::int64_t>());
  EXPECT_TRUE(searched.count(8) || searched.count(4) || searched.count(16)) << r.out;
  for (const std::int64_t b : searched)
    EXPECT_TRUE(b == 4 || b == 8 || b == 16) << b << "\n" << r.out;
  // The model's measurements are in the JSON too: each size searched, each checkpointing mode.
  ASSERT_EQ(j["model"]["measured"].size(), 9u) << j["model"].dump();
  for (const auto& row : j["model"]["measured"]) {
    const std::int64_t b = row["micro_batch"].get<std::int64_t>();
    EXPECT_TRUE(b == 4 || b == 8 || b == 16) << row.dump();
    EXPECT_GT(row["layer_forward_s"].get<double>(), 0) << row.dump();
    // The cores the emulated device's work kept busy: some, and no more than the host has.
    EXPECT_GT(row["device_cores"].get<double>(), 0.05) << row.dump();
    EXPECT_LE(row["device_cores"].get<double>(),
              j["machine"]["device_shares_host_cores"].get<double>() + 0.25)
        << row.dump();
  }
  // Without NVMe there is no drive beside the kernels to measure.
  EXPECT_EQ(j["machine"]["nvme_compute_slowdown"].get<double>(), 0);
  EXPECT_TRUE(j["machine"]["nvme_compute_slowdown_rounds"].empty()) << j["machine"].dump();
  EXPECT_EQ(j["model"]["seq_len"].get<std::int64_t>(), 32);
  EXPECT_GT(j["machine"]["device_free_gbps"].get<double>(), 0);
  const std::int64_t best = j["candidates"][0]["micro_batch"].get<std::int64_t>();
  const bool note = r.out.find("not the train_batch_size 16 of --config") != std::string::npos;
  EXPECT_EQ(note, best != 8) << r.out;
  if (note) {
    EXPECT_NE(r.out.find("(pass --micro-batches 8 to keep it)"), std::string::npos) << r.out;
  }

  // --grad-accum beside a train_batch_size keeps the global batch, as strata-train does: the
  // micro-batch follows (16 / 4 = 4: 2, 4 and 8 searched), or a --grad-accum that does not
  // divide it is refused, as strata-train refuses it.
  std::ofstream(d.path + "/global.json")
      << R"({"train_batch_size": 16, "zero_optimization": {"stage": 3}})";
  const auto ga =
      testing::run(STRATA_PROF_BIN,
                   {"--model-config", model, "--config", d.path + "/global.json", "--grad-accum",
                    "4", "--device", "cpu", "--seq-len", "32", "--no-nvme", "--out",
                    d.path + "/ga.json", "--svg", "", "--top", "1", "--json"},
                   d.path, "ga");
  ASSERT_EQ(ga.status, 0) << ga.out << ga.err;
  const auto gj = nlohmann::json::parse(ga.out.substr(ga.out.rfind('\n', ga.out.size() - 2) + 1));
  std::set<std::int64_t> sizes;
  for (const auto& row : gj["model"]["measured"])
    sizes.insert(row["micro_batch"].get<std::int64_t>());
  EXPECT_EQ(sizes, (std::set<std::int64_t>{2, 4, 8})) << ga.out;
  const auto ga3 = testing::run(STRATA_PROF_BIN,
                                {"--model-config", model, "--config", d.path + "/global.json",
                                 "--grad-accum", "3", "--device", "cpu", "--seq-len", "32",
                                 "--no-nvme", "--out", d.path + "/ga3.json", "--svg", ""},
                                d.path, "ga3");
  EXPECT_EQ(ga3.status, 1) << ga3.out << ga3.err;
  EXPECT_NE(ga3.err.find("--grad-accum 3 x 1 rank(s) does not divide the train_batch_size 16"),
            std::string::npos)
      << ga3.err;

  const auto twice =
      testing::run(STRATA_PROF_BIN,
                   {"--model-config", model, "--device", "cpu", "--seq-len", "32", "--no-nvme",
                    "--micro-batches", "2", "2", "--out", d.path + "/b2.json", "--svg", ""},
                   d.path, "twice");
  ASSERT_EQ(twice.status, 0) << twice.out << twice.err;
  std::size_t rows = 0;
  for (std::size_t at = twice.out.find("\n  2      off"); at != std::string::npos;
       at = twice.out.find("\n  2      off", at + 1))
    ++rows;
  EXPECT_EQ(rows, 1u) << twice.out;
}

// What the search does not decide stays as the --config says (its dtype and accumulation were
// replaced by the flags' defaults, its scheduler and bias_correction dropped), and NVMe is
// measured and planned on its nvme_path (a scratch folder was used instead).
TEST(ProfCli, TheConfigsSettingsAndNvmePathStand) {
  TempDir d("strata-prof");
  const std::string model = tiny_model(d.path), nv = d.path + "/my-nvme", ds = d.path + "/ds.json";
  fs::create_directories(nv);
  std::ofstream(ds) << R"({"bf16": {"enabled": true}, "gradient_accumulation_steps": 3,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "bias_correction": false}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": ")" +
                           nv + R"("}}})";
  // (the drive's short runs only: its sustained rate is another test's, RecommendationIs...)
  const std::vector<std::string> common = {
      "--model-config",  model, "--device",   "cpu", "--device-mem-gb",  "0.02", "--seq-len", "32",
      "--micro-batches", "2",   "--validate", "0",   "--nvme-sustain-s", "0",    "--svg",     ""};
  auto with = [&](std::vector<std::string> more) {
    std::vector<std::string> v = common;
    v.insert(v.end(), more.begin(), more.end());
    return v;
  };
  const auto r = testing::run(STRATA_PROF_BIN,
                              with({"--config", ds, "--out", d.path + "/best.json", "--json"}),
                              d.path, "prof");
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("seq 32, bf16"), std::string::npos) << r.out;
  const auto j = nlohmann::json::parse(r.out.substr(r.out.rfind('\n', r.out.size() - 2) + 1));
  EXPECT_EQ(j["machine"]["nvme_path"], nv);
  // --validate 0: predictions held to nothing, and the JSON says so.
  EXPECT_EQ(j["reference"].get<std::string>().rfind("none: predictions only", 0), 0u) << j.dump();
  const auto best = nlohmann::json::parse(testing::slurp(d.path + "/best.json"));
  EXPECT_EQ(best["bf16"]["enabled"], true) << best.dump();
  EXPECT_EQ(best["gradient_accumulation_steps"], 3) << best.dump();
  EXPECT_EQ(best["scheduler"]["type"], "WarmupLR") << best.dump();
  EXPECT_EQ(best["optimizer"]["params"]["bias_correction"], false) << best.dump();
  // This machine's defaults stay out of it (strata-train works them out where it runs).
  EXPECT_FALSE(best.contains("strata") && best["strata"].contains("host_budget_bytes"))
      << best.dump();
  EXPECT_FALSE(best.contains("strata") && best["strata"].contains("device_grad_norm"))
      << best.dump();
  EXPECT_FALSE(best.contains("strata") && best["strata"].contains("overlap_optimizer"))
      << best.dump();
  // The user's --config is never the file written.
  const auto same =
      testing::run(STRATA_PROF_BIN, with({"--config", ds, "--out", ds}), d.path, "same");
  EXPECT_EQ(same.status, 1) << same.out << same.err;
  EXPECT_NE(same.err.find("is the --config file"), std::string::npos) << same.err;
  EXPECT_NE(testing::slurp(ds).find("WarmupLR"), std::string::npos) << "the --config was changed";
  if (best["zero_optimization"]["offload_optimizer"]["device"] == "nvme") {
    EXPECT_EQ(best["zero_optimization"]["offload_optimizer"]["nvme_path"], nv) << best.dump();
  }
  // The flags still win when given.
  const auto f = testing::run(STRATA_PROF_BIN,
                              with({"--config", ds, "--dtype", "fp32", "--grad-accum", "2", "--out",
                                    d.path + "/flags.json"}),
                              d.path, "flags");
  ASSERT_EQ(f.status, 0) << f.out << f.err;
  const auto flags = nlohmann::json::parse(testing::slurp(d.path + "/flags.json"));
  EXPECT_FALSE(flags.contains("bf16")) << flags.dump();
  EXPECT_EQ(flags["gradient_accumulation_steps"], 2) << flags.dump();
  // fp16, which strata-train refuses, is refused here before anything is measured.
  std::ofstream(d.path + "/fp16.json")
      << R"({"fp16": {"enabled": true}, "zero_optimization": {"stage": 3}})";
  const auto h =
      testing::run(STRATA_PROF_BIN, with({"--config", d.path + "/fp16.json"}), d.path, "fp16");
  EXPECT_EQ(h.status, 1) << h.out << h.err;
  EXPECT_NE(h.err.find("fp16"), std::string::npos) << h.err;
  // A config's nvme_path that does not exist is named.
  std::ofstream(d.path + "/gone.json") << R"({"zero_optimization": {"stage": 3, "offload_optimizer":
    {"device": "nvme", "nvme_path": ")" + d.path +
                                              R"(/gone"}}})";
  const auto g =
      testing::run(STRATA_PROF_BIN, with({"--config", d.path + "/gone.json"}), d.path, "gone");
  EXPECT_EQ(g.status, 1) << g.out << g.err;
  EXPECT_NE(g.err.find(d.path + "/gone"), std::string::npos) << g.err;
  // aio.verify on: the drive is measured with reads of whole writes only (a read of 64 KiB of a
  // 1 MiB write was refused, and strata-prof with it).
  std::ofstream(d.path + "/verify.json")
      << R"({"aio": {"verify": true}, "zero_optimization": {"stage": 3,
    "offload_optimizer": {"device": "nvme", "nvme_path": ")" +
             nv + R"("}}})";
  const auto v = testing::run(
      STRATA_PROF_BIN, with({"--config", d.path + "/verify.json", "--out", d.path + "/v.json"}),
      d.path, "verify");
  EXPECT_EQ(v.status, 0) << v.out << v.err;
  // One that cannot be written is named as the --config's key, not as --nvme-path (not given).
  struct statvfs sv {};
  if (::statvfs("/proc/sys", &sv) == 0 && (sv.f_flag & ST_RDONLY)) {
    std::ofstream(d.path + "/ro.json") << R"({"zero_optimization": {"stage": 3, "offload_optimizer":
      {"device": "nvme", "nvme_path": "/proc/sys"}}})";
    const auto ro =
        testing::run(STRATA_PROF_BIN, with({"--config", d.path + "/ro.json"}), d.path, "ro");
    EXPECT_EQ(ro.status, 1) << ro.out << ro.err;
    EXPECT_NE(ro.err.find("config key 'zero_optimization.offload_optimizer.nvme_path' = "
                          "'/proc/sys' is read-only"),
              std::string::npos)
        << ro.err;
  }
}

// The recommendation keeps what the user wrote where it does not change what was decided:
// Hugging Face's "auto" placeholders, keys strata does not use, defaults written out (it wrote
// strata's whole config: every "auto" became a number, and a Trainer given the file back found
// values that disagree with its own arguments).
TEST(ProfCli, TheConfigsOwnKeysAndAutosAreKeptAsWritten) {
  TempDir d("strata-prof");
  const std::string model = tiny_model(d.path), ds = d.path + "/hf.json",
                    out = d.path + "/best.json";
  std::ofstream(ds)
      << R"({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "steps_per_print": 10, "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "betas": [0.9, 0.95]}},
    "zero_optimization": {"stage": 3, "round_robin_gradients": true, "overlap_comm": true,
                          "stage3_gather_16bit_weights_on_model_save": false}})";
  const auto r = testing::run(
      STRATA_PROF_BIN,
      {"--model-config", model, "--device", "cpu", "--device-mem-gb", "0.02", "--seq-len", "32",
       "--micro-batches", "2", "--no-nvme", "--svg", "", "--config", ds, "--out", out},
      d.path, "prof");
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  const auto best = nlohmann::json::parse(testing::slurp(out));
  EXPECT_EQ(best["gradient_accumulation_steps"], "auto") << best.dump();
  EXPECT_EQ(best["bf16"]["enabled"], "auto") << best.dump();
  EXPECT_EQ(best["optimizer"]["params"]["lr"], "auto") << best.dump();
  EXPECT_EQ(best["optimizer"]["params"]["weight_decay"], "auto") << best.dump();
  EXPECT_EQ(best["optimizer"]["params"]["betas"], nlohmann::json({0.9, 0.95})) << best.dump();
  EXPECT_EQ(best["steps_per_print"], 10) << best.dump();
  EXPECT_EQ(best["zero_optimization"]["round_robin_gradients"], true) << best.dump();
  // A default the file leaves out is the user's to keep (strata-train warns of it: their choice).
  EXPECT_EQ(best["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"], false)
      << best.dump();
  // What the search decided is written as decided: the micro-batch it measured.
  EXPECT_EQ(best["train_micro_batch_size_per_gpu"], 2) << best.dump();
  // ... and the file means what the search chose.
  const EngineConfig kept = parse_engine_config(best.dump(), 1);
  EXPECT_EQ(kept.micro_batch_per_gpu, 2);
  EXPECT_EQ(kept.gradient_accumulation_steps, 1);
  EXPECT_EQ(kept.compute_dtype, DType::kF32);
}

// The demo model profiled: the command printed to run the recommendation names a model config
// (strata-train without one trains the demo under its own 20 MiB cap, which the plan was not
// made for), and that command's plan fits.
TEST(ProfCli, TheDemosRunLineNamesItsModelAndFits) {
  TempDir d("strata-prof");
  const auto r = testing::run(STRATA_PROF_BIN,
                              {"--device", "cpu", "--micro-batches", "2", "--no-nvme", "--validate",
                               "0", "--out", d.path + "/best.json", "--svg", ""},
                              d.path, "prof");
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  const std::string mc = d.path + "/best.model.json";
  EXPECT_NE(r.out.find("strata-train --model-config " + mc + " --config " + d.path + "/best.json"),
            std::string::npos)
      << r.out;
  ASSERT_TRUE(fs::exists(mc));
  // A file of the user's where the demo's model config would go is not replaced.
  std::ofstream(d.path + "/mine.model.json") << "{\"mine\": true}";
  const auto mine = testing::run(STRATA_PROF_BIN,
                                 {"--device", "cpu", "--micro-batches", "2", "--no-nvme",
                                  "--validate", "0", "--out", d.path + "/mine.json", "--svg", ""},
                                 d.path, "mine");
  EXPECT_EQ(mine.status, 1) << mine.out << mine.err;
  EXPECT_NE(mine.err.find("is not the demo model's config"), std::string::npos) << mine.err;
  EXPECT_EQ(testing::slurp(d.path + "/mine.model.json"), "{\"mine\": true}");
  // --out a stream (here a link to stdout, as /dev/stdout is): the recommendation written into it,
  // no model file beside it (--out /dev/null made /dev/null.model.json), no run line.
  const std::string link = d.path + "/to-stdout";
  ASSERT_EQ(::symlink("/proc/self/fd/1", link.c_str()), 0);
  const auto stream = testing::run(STRATA_PROF_BIN,
                                   {"--device", "cpu", "--micro-batches", "2", "--no-nvme",
                                    "--validate", "0", "--out", link, "--svg", ""},
                                   d.path, "stream");
  EXPECT_EQ(stream.status, 0) << stream.out << stream.err;
  EXPECT_NE(stream.out.find("\"zero_optimization\""), std::string::npos) << stream.out;
  EXPECT_NE(stream.out.find("best configuration written to " + link + " (a stream"),
            std::string::npos)
      << stream.out;
  EXPECT_TRUE(fs::is_symlink(link)) << "replaced";
  EXPECT_FALSE(fs::exists(d.path + "/to-stdout.model.json"));
  const auto plan = testing::run(STRATA_TRAIN_BIN,
                                 {"--model-config", mc, "--config", d.path + "/best.json",
                                  "--seq-len", "128", "--device", "cpu", "--plan"},
                                 d.path, "plan");
  EXPECT_EQ(plan.status, 0) << plan.out << plan.err;
  EXPECT_NE(plan.out.find("verdict: fits"), std::string::npos) << plan.out;
  // No key the user never wrote that strata-train warns of (a false
  // stage3_gather_16bit_weights_on_model_save was written into every file).
  EXPECT_EQ(plan.err.find("gather_16bit"), std::string::npos) << plan.err;
  EXPECT_EQ(testing::slurp(d.path + "/best.json").find("gather_16bit"), std::string::npos);
}

#ifdef STRATA_MPIEXEC
// strata-prof on `np` ranks under mpirun with `args`, `env` added to the ranks' environment.
testing::Result prof_ranks(int np, std::vector<std::string> args, const std::string& dir,
                           const std::string& tag,
                           std::vector<std::pair<std::string, std::string>> env = {}) {
  args.insert(args.begin(), {"-np", std::to_string(np), "--oversubscribe", STRATA_PROF_BIN});
  env.insert(env.end(), {{"OMPI_ALLOW_RUN_AS_ROOT", "1"},
                         {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"},
                         {"STRATA_COMM_TIMEOUT_S", "120"}});
  return testing::run(STRATA_MPIEXEC, args, dir, tag, env);
}

// The tiny model at `model` on a 20 MiB emulated device, B=2, T=32, no NVMe, validated once for 2
// steps, its files in `dir`, --json.
std::vector<std::string> validated_tiny(const std::string& model, const std::string& dir) {
  return {"--model-config",
          model,
          "--device",
          "cpu",
          "--device-mem-gb",
          "0.02",
          "--seq-len",
          "32",
          "--micro-batches",
          "2",
          "--no-nvme",
          "--validate",
          "1",
          "--validate-steps",
          "2",
          "--out",
          dir + "/best.json",
          "--svg",
          "",
          "--trace",
          dir + "/trace.json",
          "--json"};
}

// Three ranks (a world size that does not divide the collective benchmark's 2^24 elements, which
// was refused) profile, search with the slowest rank's figures, and validate the same candidate.
TEST(ProfCli, ThreeRanksSearchAlikeAndValidate) {
  if (!std::getenv("STRATA_TEST_MPI"))
    GTEST_SKIP() << "runs as the prof_mpi test (STRATA_TEST_MPI=1)";
  TempDir d("strata-prof");
  const std::string model = tiny_model(d.path);
  const auto r = prof_ranks(3, validated_tiny(model, d.path), d.path, "prof3");
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("3 ranks: the search takes the slowest rank's figures"), std::string::npos)
      << r.out;
  const auto j = nlohmann::json::parse(r.out.substr(r.out.rfind('\n', r.out.size() - 2) + 1));
  EXPECT_EQ(j["machine"]["world_size"], 3);
  EXPECT_GT(j["machine"]["all_gather_gbps"].get<double>(), 0);
  EXPECT_GT(j["candidates"][0]["measured_step_s"].get<double>(), 0);
  // The run line says how it was profiled, as it does for tensor parallelism.
  EXPECT_NE(r.out.find("(under mpirun -np 3, as profiled: 3 data-parallel ranks)"),
            std::string::npos)
      << r.out;
}

// A validation run that fails on one rank of several ends the job with that run's error, the
// candidate named: the ranks run each candidate together, and that rank going on to the next run
// left the others waiting in this one's communicator for ever.
TEST(ProfCli, TwoRanksEndTheJobWhenAValidationRunFailsOnOne) {
  if (!std::getenv("STRATA_TEST_MPI"))
    GTEST_SKIP() << "runs as the prof_mpi test (STRATA_TEST_MPI=1)";
  TempDir d("strata-prof");
  const std::string model = tiny_model(d.path);
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = prof_ranks(2, validated_tiny(model, d.path), d.path, "prof-fail",
                            {{"STRATA_TEST_FAIL_VALIDATION_RANK", "1"}});
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.err.find("validating #1 ("), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("failed on this rank: --data "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("the job's ranks validate in step"), std::string::npos) << r.err;
  // Ended by the failing rank, not by the other's communicator timing out (120 s).
  EXPECT_LT(s, 100) << r.err;
}

// Tensor parallelism (mpirun -np 2 --tensor-parallel 2): each rank measures and plans its own
// slices, the TP all-reduces are counted (4 of a micro-batch's activations a layer: 2 forward, 2
// backward), shown on the "tp" lane predicted and measured, and named "tp.all_reduce" in the
// trace; the run line and the validation runs take the TP size.
TEST(ProfCli, TwoRanksTensorParallelPlanTheirSlicesAndCountTheAllReduces) {
  if (!std::getenv("STRATA_TEST_MPI"))
    GTEST_SKIP() << "runs as the prof_mpi test (STRATA_TEST_MPI=1)";
  TempDir d("strata-prof");
  const std::string model = tiny_model(d.path);
  std::vector<std::string> args = validated_tiny(model, d.path);
  args.insert(args.end(), {"--tensor-parallel", "2", "--validate-spread", "0"});
  *(std::find(args.begin(), args.end(), "--svg") + 1) = d.path + "/tp.svg";  // the tp lane drawn
  const auto r = prof_ranks(2, args, d.path, "prof-tp");
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("tensor parallel 2 x data parallel 1"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("--tensor-parallel 2 --device cpu"), std::string::npos) << r.out;
  const auto j = nlohmann::json::parse(r.out.substr(r.out.rfind('\n', r.out.size() - 2) + 1));
  EXPECT_EQ(j["machine"]["world_size"], 2);
  EXPECT_EQ(j["machine"]["tensor_parallel"], 2);
  EXPECT_EQ(j["machine"]["data_parallel"], 1);
  EXPECT_GT(j["machine"]["tp_all_reduce_gbps"].get<double>(), 0);
  // Half of every split matrix, the vocabulary's rows too; norms whole.
  const double all = j["model"]["params"].get<double>(),
               mine = j["model"]["params_per_rank"].get<double>();
  EXPECT_GT(mine, 0.5 * all);
  EXPECT_LT(mine, 0.52 * all);
  for (const auto& row : j["model"]["measured"]) {
    if (row["checkpoint"] == "off") {
      EXPECT_EQ(row["layer_tp_bytes"].get<std::uint64_t>(), 4u * 2 * 32 * 64 * 4) << row;
    }
  }
  const auto& best = j["candidates"][0];
  EXPECT_GT(best["busy_s"]["tp"].get<double>(), 0) << best;
  EXPECT_GT(best["measured_busy_s"]["tp"].get<double>(), 0) << best;
  std::ifstream tf(d.path + "/trace.json");
  std::stringstream ts;
  ts << tf.rdbuf();
  EXPECT_NE(ts.str().find("\"tp.all_reduce\""), std::string::npos);
  std::ifstream svg(d.path + "/tp.svg");
  std::stringstream ss;
  ss << svg.rdbuf();
  EXPECT_NE(ss.str().find(">tp</text>"), std::string::npos) << "no tp lane in the picture";
  // A TP size the job's ranks are not a multiple of: refused before anything is measured.
  const auto bad = prof_ranks(2,
                              {"--model-config", model, "--device", "cpu", "--no-nvme",
                               "--tensor-parallel", "4", "--out", d.path + "/b.json", "--svg", ""},
                              d.path, "prof-tp-bad");
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.err.find("--tensor-parallel 4: tensor parallelism splits each layer over 4 ranks, "
                         "and this job has 2"),
            std::string::npos)
      << bad.err;
  EXPECT_EQ(bad.out.find("machine ("), std::string::npos) << "measured first: " << bad.out;
}
#endif

// What is written at the end is checked before anything is measured: a folder that is not there
// (or a file where it should be) is named with the flag and the reason (it failed after the
// measuring and the search, --svg after --out was written), and a file already there is the
// user's until --overwrite.
TEST(ProfCli, OutputsAreCheckedBeforeAnythingIsMeasured) {
  TempDir d("strata-prof");
  std::ofstream(d.path + "/file") << "a file";
  auto prof = [&](std::vector<std::string> more, const std::string& tag) {
    std::vector<std::string> args = {"--device", "cpu", "--micro-batches", "2", "--no-nvme",
                                     "--top",    "1"};
    args.insert(args.end(), more.begin(), more.end());
    return testing::run(STRATA_PROF_BIN, args, d.path, tag);
  };
  const struct {
    std::vector<std::string> flags;
    std::string error;
  } bad[] = {
      {{"--out", d.path + "/nodir/best.json", "--svg", ""},
       "--out " + d.path + "/nodir/best.json: the folder " + d.path +
           "/nodir does not exist: create it first"},
      {{"--out", d.path + "/a.json", "--svg", d.path + "/file/prof.svg"},
       "--svg " + d.path + "/file/prof.svg: cannot be written in " + d.path +
           "/file: Not a directory"},
      {{"--out", d.path + "/a.json", "--svg", "", "--validate", "1", "--trace",
        d.path + "/nodir/trace.json"},
       "--trace " + d.path + "/nodir/trace.json: the folder " + d.path +
           "/nodir does not exist: create it first"},
  };
  int n = 0;
  for (const auto& c : bad) {
    const auto r = prof(c.flags, "bad" + std::to_string(n++));
    EXPECT_EQ(r.status, 1) << r.out << r.err;
    EXPECT_NE(r.err.find(c.error), std::string::npos) << r.err;
    EXPECT_EQ(r.out.find("machine ("), std::string::npos) << "measured first: " << r.out;
  }
  EXPECT_FALSE(fs::exists(d.path + "/a.json"));
  // A file already there is not replaced without --overwrite (nor is anything else written).
  std::ofstream(d.path + "/best.json") << "mine";
  std::ofstream(d.path + "/prof.svg") << "mine";
  auto r = prof({"--out", d.path + "/best.json", "--svg", ""}, "out");
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_NE(r.err.find("--out " + d.path + "/best.json exists: pass --overwrite to replace it"),
            std::string::npos)
      << r.err;
  r = prof({"--out", d.path + "/new.json", "--svg", d.path + "/prof.svg"}, "svg");
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_NE(r.err.find("--svg " + d.path + "/prof.svg exists: pass --overwrite to replace it"),
            std::string::npos)
      << r.err;
  EXPECT_FALSE(fs::exists(d.path + "/new.json"));
  EXPECT_EQ(testing::slurp(d.path + "/best.json"), "mine");
  EXPECT_EQ(testing::slurp(d.path + "/prof.svg"), "mine");
  r = prof({"--out", d.path + "/best.json", "--svg", d.path + "/prof.svg", "--overwrite"},
           "overwrite");
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_TRUE(
      nlohmann::json::parse(testing::slurp(d.path + "/best.json")).contains("zero_optimization"));
  EXPECT_NE(testing::slurp(d.path + "/prof.svg").find("predicted step"), std::string::npos);
}

TEST(ProfCli, ImpossibleRequestNamesWhatIsMissing) {
  TempDir d("strata-prof");
  const std::string model = tiny_model(d.path);
  const auto r = testing::run(STRATA_PROF_BIN,
                              {"--model-config", model, "--device", "cpu", "--device-mem-gb",
                               "0.0001", "--host-mem-gb", "0.002", "--no-nvme", "--seq-len", "32",
                               "--micro-batches", "1", "--out", d.path + "/best.json", "--svg", ""},
                              d.path, "prof");
  EXPECT_EQ(r.status, 2) << r.out << r.err;
  EXPECT_NE(r.out.find("no placement fits"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("  device: needs "), std::string::npos) << r.out;
  // Which configuration that plan is, and the way out in strata-prof's own flags.
  EXPECT_NE(r.out.find("closest to fitting (the fewest bytes missing over all tiers), params "),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("strata-prof's own ways out: a larger --device-mem-gb or --host-mem-gb"),
            std::string::npos)
      << r.out;
  // The table's device capacity is 90% of the device's: said (0.0001 GiB is 104.86 KiB).
  EXPECT_NE(
      r.out.find(
          "(a plan may fill 90% of the device's memory, 94.37 KiB of 104.86 KiB: the rest is the "
          "allocator's)"),
      std::string::npos)
      << r.out;
  EXPECT_FALSE(fs::exists(d.path + "/best.json"));
  // Host RAM short (a fake /proc/meminfo of 512 KiB available), the device and the pinned budget
  // not: the ways out are the tiers that are short, not a larger --device-mem-gb or --host-mem-gb
  // (which it said), neither of which adds RAM.
  const std::string meminfo = d.path + "/meminfo";
  std::ofstream(meminfo) << "MemTotal:       1048576 kB\nMemAvailable:        512 kB\n";
  const auto ram = testing::run(
      STRATA_PROF_BIN,
      {"--model-config", model, "--device", "cpu", "--device-mem-gb", "0.02", "--no-nvme",
       "--seq-len", "32", "--micro-batches", "2", "--out", d.path + "/best.json", "--svg", ""},
      d.path, "ram", {{"STRATA_TEST_MEMINFO", meminfo}});
  EXPECT_EQ(ram.status, 2) << ram.out << ram.err;
  EXPECT_NE(ram.out.find("host RAM: needs"), std::string::npos) << ram.out;
  EXPECT_NE(ram.out.find("strata-prof's own ways out: --micro-batches below 2, or NVMe (leave out "
                         "--no-nvme) (host RAM is short: the closest plan needs "),
            std::string::npos)
      << ram.out;
  EXPECT_EQ(ram.out.find("a larger --"), std::string::npos) << ram.out;
}

// A micro-batch the device cannot hold while measured is left out of the search, its candidates
// "does not fit", and the search goes on with the others (the whole profile ended in a raw
// out-of-memory error); one that holds more than one that ran out is not tried. Every size
// running out is an error naming the flags. A model whose MLP is 2^18 wide on 8 dimensions: B
// = 4096 x 8 tokens asks for 32 GiB at once, past the 8 GiB the copies are measured on.
TEST(ProfCli, AMicroBatchTheDeviceCannotHoldIsLeftOut) {
  TempDir d("strata-prof");
  const std::string model = d.path + "/wide.json";
  std::ofstream(model) << R"({"model_type": "llama", "vocab_size": 256, "hidden_size": 8,
      "intermediate_size": 262144, "num_hidden_layers": 2, "num_attention_heads": 2,
      "num_key_value_heads": 1, "max_position_embeddings": 64})";
  auto prof = [&](std::vector<std::string> sizes, const std::string& tag) {
    std::vector<std::string> args = {"--model-config",
                                     model,
                                     "--device",
                                     "cpu",
                                     "--no-nvme",
                                     "--seq-len",
                                     "8",
                                     "--out",
                                     d.path + "/best.json",
                                     "--svg",
                                     "",
                                     "--overwrite",
                                     "--json",
                                     "--micro-batches"};
    args.insert(args.end(), sizes.begin(), sizes.end());
    return testing::run(STRATA_PROF_BIN, args, d.path, tag);
  };
  const auto r = prof({"1", "4096"}, "some");
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("4096   host  does not fit, left out of the search: out of memory while "
                       "measured: "),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("4096   off   does not fit, left out of the search: holds more than "
                       "B=4096 with checkpointing host, which ran out"),
            std::string::npos)
      << r.out;
  const auto j = nlohmann::json::parse(r.out.substr(r.out.rfind('\n', r.out.size() - 2) + 1));
  EXPECT_EQ(j["model"]["measured"].size(), 3u) << j["model"].dump();
  ASSERT_EQ(j["model"]["does_not_fit"].size(), 3u) << j["model"].dump();
  for (const auto& x : j["model"]["does_not_fit"]) EXPECT_EQ(x["micro_batch"], 4096) << x;
  for (const auto& c : j["candidates"]) EXPECT_EQ(c["micro_batch"], 1) << c;
  EXPECT_EQ(nlohmann::json::parse(
                testing::slurp(d.path + "/best.json"))["train_micro_batch_size_per_gpu"],
            1);
  const auto none = prof({"4096"}, "none");
  EXPECT_EQ(none.status, 1) << none.out << none.err;
  EXPECT_NE(none.err.find("every micro-batch size searched ran out of memory while measured, "
                          "with checkpointing and without (--micro-batches 4096 at --seq-len 8; "),
            std::string::npos)
      << none.err;
  EXPECT_NE(none.err.find("give smaller --micro-batches or a shorter --seq-len"), std::string::npos)
      << none.err;
}

// A --nvme-path (or a --config nvme_path) on a drive without room for strata-prof's own
// measurement of it is said before anything is written there, with how much it needs and both
// ways out (the swap store refused once a reserve failed, naming neither --no-nvme nor the
// measurement). Needs root to mount a 32 MiB tmpfs; Skipped elsewhere.
TEST(ProfCli, ADriveTooSmallToMeasureIsSaidFirst) {
  TempDir d("strata-prof");
  const std::string mnt = d.path + "/small", model = tiny_model(d.path);
  testing::SmallTmpfs small(mnt, 32);
  if (!small.ok) GTEST_SKIP() << small.why;
  const std::string ds = d.path + "/nvme.json";
  std::ofstream(ds) << R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme",
      "nvme_path": ")" + mnt +
                           R"("}}})";
  for (const auto& [flags, named] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--nvme-path", mnt}, "--nvme-path " + mnt},
           {{"--config", ds}, "zero_optimization.offload_optimizer.nvme_path " + mnt}}) {
    std::vector<std::string> args = {"--model-config",  model,
                                     "--device",        "cpu",
                                     "--seq-len",       "32",
                                     "--micro-batches", "2",
                                     "--out",           d.path + "/best.json",
                                     "--svg",           ""};
    args.insert(args.end(), flags.begin(), flags.end());
    const auto r = testing::run(STRATA_PROF_BIN, args, d.path, "small");
    EXPECT_EQ(r.status, 1) << r.out << r.err;
    EXPECT_NE(r.err.find(named + ": strata-prof measures the drive with "), std::string::npos)
        << r.err;
    EXPECT_NE(r.err.find(" MiB are free: free space there, give --nvme-path on a drive with more, "
                         "or --no-nvme to leave NVMe out of the search"),
              std::string::npos)
        << r.err;
    EXPECT_EQ(r.out.find("machine ("), std::string::npos) << "measured first: " << r.out;
    EXPECT_TRUE(fs::is_empty(mnt));
  }
}

TEST(ProfCli, BadInputIsAClearError) {
  TempDir d("strata-prof");
  const auto r =
      testing::run(STRATA_PROF_BIN, {"--model-config", d.path + "/missing.json"}, d.path, "prof");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("missing.json"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find(".cpp:"), std::string::npos)
      << "bad input needs no source location: " << r.err;
  // With --json, the last line of stdout says why there are no figures.
  const auto j = testing::run(
      STRATA_PROF_BIN, {"--model-config", d.path + "/missing.json", "--json"}, d.path, "json");
  EXPECT_EQ(j.status, 1);
  const std::string last = j.out.substr(j.out.rfind('{'));
  const auto obj = nlohmann::json::parse(last);
  EXPECT_NE(obj.at("error").get<std::string>().find("missing.json"), std::string::npos) << last;
  // (a missing file the user named is bad input, as a missing --data is)
  EXPECT_EQ(obj.at("kind").get<std::string>(), "invalid argument") << last;
  // A bad command line exits 1 too (not CLI11's own codes), and a missing --nvme-path is refused
  // (not created: a typo must not profile another drive).
  EXPECT_EQ(testing::run(STRATA_PROF_BIN, {"--validate", "abc"}, d.path, "flag").status, 1);
  const auto sus = testing::run(STRATA_PROF_BIN, {"--nvme-sustain-s", "-1"}, d.path, "sustain");
  EXPECT_EQ(sus.status, 1);
  EXPECT_NE(sus.err.find("--nvme-sustain-s -1: give seconds from 0"), std::string::npos) << sus.err;
  const auto nv = testing::run(STRATA_PROF_BIN, {"--nvme-path", d.path + "/nope"}, d.path, "nvme");
  EXPECT_EQ(nv.status, 1);
  EXPECT_NE(nv.err.find("--nvme-path " + d.path + "/nope: no such directory"), std::string::npos)
      << nv.err;
  EXPECT_FALSE(fs::exists(d.path + "/nope"));
  std::ofstream(d.path + "/afile") << "x";  // a file there: "create it" would not do
  const auto nf =
      testing::run(STRATA_PROF_BIN, {"--nvme-path", d.path + "/afile"}, d.path, "nvme-file");
  EXPECT_EQ(nf.status, 1);
  EXPECT_NE(nf.err.find("--nvme-path " + d.path + "/afile: a file, not a folder"),
            std::string::npos)
      << nf.err;
  // Two flags that contradict each other: both named (the path was ignored).
  const std::vector<std::string> out = {"--out", d.path + "/best.json", "--svg", "", "--device",
                                        "cpu"};
  auto with = [&](std::vector<std::string> v) {
    v.insert(v.end(), out.begin(), out.end());
    return v;
  };
  const auto both =
      testing::run(STRATA_PROF_BIN, with({"--no-nvme", "--nvme-path", d.path}), d.path, "both");
  EXPECT_EQ(both.status, 1) << both.out << both.err;
  EXPECT_NE(both.err.find("--no-nvme and --nvme-path " + d.path), std::string::npos) << both.err;
  // Flags that would be ignored, or two outputs naming one file (the later replaced the
  // recommendation: an SVG or a trace handed to strata-train as --config), refused before
  // anything is measured, naming the fix.
  std::ofstream(d.path + "/t.txt") << "text";
  {
    std::vector<std::uint16_t> ids(64, 3);
    std::ofstream(d.path + "/raw.ids", std::ios::binary)
        .write(reinterpret_cast<const char*>(ids.data()), std::streamsize(ids.size() * 2));
  }
  std::ofstream(d.path + "/t.jsonl") << R"({"text": "a document"})"
                                     << "\n";
  // Raw ids the tiny model (vocab 256) reads: 8 of them (no window of --seq-len 16 + 1), and 64
  // of 300 (outside the vocabulary). Both measured everything, then failed every validation run.
  const auto ids_file = [&](const std::string& name, std::vector<std::uint16_t> ids) {
    std::ofstream(d.path + "/" + name, std::ios::binary)
        .write(reinterpret_cast<const char*>(ids.data()), std::streamsize(ids.size() * 2));
    return d.path + "/" + name;
  };
  const std::string short_ids = ids_file("short.u16", {1, 2, 3, 4, 5, 6, 7, 8}),
                    oov_ids = ids_file("oov.u16", std::vector<std::uint16_t>(64, 300)),
                    tiny = tiny_model(d.path);
  const std::string v32k = d.path + "/v32k.json";
  std::ofstream(v32k) << R"({"model_type": "llama", "vocab_size": 32000, "hidden_size": 64,
      "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4})";
  for (const auto& [flags, says] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--svg", d.path + "/best.json"}, "--out and --svg both name " + d.path + "/best.json"},
           {{"--validate", "1", "--trace", d.path + "/best.json"}, "--out and --trace both name"},
           {{"--trace", d.path + "/t.json"},
            "--trace, --data, --text, --validate-spread and --validate-rounds are for the "
            "validation runs: add --validate K"},
           {{"--validate-spread", "2"}, "--validate-rounds are for the validation runs"},
           {{"--validate-rounds", "3"}, "--validate-rounds are for the validation runs"},
           {{"--micro-batch", "4", "--micro-batches", "2"}, "--micro-batch 4 and --micro-batches"},
           {{"--validate", "1", "--data", d.path + "/nope.bin"},
            "--data " + d.path + "/nope.bin: no such file"},
           {{"--validate", "1", "--data", d.path + "/t.txt", "--text", d.path + "/t.txt"},
            "--data and --text"},
           {{"--validate", "1", "--data", d.path + "/t.jsonl"},
            d.path + "/t.jsonl: this is JSON lines text, not token ids"},
           {{"--validate", "1", "--model-config", v32k, "--text", d.path + "/t.txt"},
            "text is read byte by byte"},
           {{"--validate", "1", "--data", d.path + "/raw.ids"},
            d.path + "/raw.ids: no header (not a strata-prep file, not an llm.c .bin) and not "
                     ".txt, so its format is unknown: give raw token ids' width with --data-dtype "
                     "u16 or u32"},
           // The validation data at the --seq-len and micro-batch the runs read it at.
           {{"--validate", "1", "--model-config", tiny, "--seq-len", "16", "--micro-batches", "2",
             "--data", short_ids, "--data-dtype", "u16"},
            "has no window of --seq-len + 1 = 17 tokens"},
           {{"--validate", "1", "--model-config", tiny, "--seq-len", "16", "--micro-batches", "2",
             "--data", oov_ids, "--data-dtype", "u16"},
            oov_ids + ": token id 300 at byte offset "},
           // Sizes no step can hold (a step reads all its micro-batches first), as strata-train
           // refuses them: 2^62 micro-batches hung, 2 x a 2^62 micro-batch wrapped, a sequence of
           // 10^11 tokens ran out of memory measuring.
           {{"--micro-batches", "1", "--seq-len", "16", "--grad-accum", "4611686018427387904"},
            "--grad-accum 4611686018427387904 x a micro-batch of 1 x --seq-len 16 tokens (the "
            "largest of --micro-batches): a step holds all its micro-batches before its first "
            "forward"},
           {{"--micro-batch", "4611686018427387904"},
            "(2B of B = 4611686018427387904: the search tries B/2, B and 2B"},
           {{"--seq-len", "100000000000"}, "x --seq-len 100000000000 tokens"},
           // GiB past a 64-bit count of bytes (wrapped to 0).
           {{"--device-mem-gb", "1e30"},
            "--device-mem-gb 1e+30: more bytes than a 64-bit count holds"},
           {{"--host-mem-gb", "1e30"},
            "--host-mem-gb 1e+30: more bytes than a 64-bit count holds"}}) {
    std::vector<std::string> v = {"--out", d.path + "/best.json", "--device", "cpu", "--no-nvme"};
    v.insert(v.end(), flags.begin(), flags.end());
    const auto bad = testing::run(STRATA_PROF_BIN, v, d.path, "combo");
    EXPECT_EQ(bad.status, 1) << says << "\n" << bad.out << bad.err;
    EXPECT_NE(bad.err.find(says), std::string::npos) << bad.err;
    EXPECT_EQ(bad.out.find("machine ("), std::string::npos) << "measured first: " << bad.out;
  }
  // An output naming a file strata-prof reads is refused, --overwrite or not (the model's
  // config was replaced by the recommendation, and the validation runs read it back).
  const std::string m2 = d.path + "/m2.json";
  fs::copy_file(tiny_model(d.path), m2, fs::copy_options::overwrite_existing);
  const auto self = testing::run(STRATA_PROF_BIN,
                                 {"--model-config", m2, "--out", d.path + "/./m2.json",
                                  "--overwrite", "--device", "cpu", "--no-nvme"},
                                 d.path, "self");
  EXPECT_EQ(self.status, 1) << self.out << self.err;
  EXPECT_NE(self.err.find("is the --model-config file: strata-prof would replace it"),
            std::string::npos)
      << self.err;
  EXPECT_EQ(self.out.find("machine ("), std::string::npos) << "measured first: " << self.out;
  // A GPT-2 sequence longer than its positions, as strata-train says it, before measuring.
  std::ofstream(d.path + "/gpt2.json")
      << R"({"model_type": "gpt2", "vocab_size": 71, "n_embd": 24, "n_layer": 2,
      "n_head": 2, "n_positions": 32})";
  const auto pos = testing::run(STRATA_PROF_BIN,
                                {"--model-config", d.path + "/gpt2.json", "--seq-len", "64",
                                 "--device", "cpu", "--no-nvme", "--out", d.path + "/best.json"},
                                d.path, "positions");
  EXPECT_EQ(pos.status, 1) << pos.out << pos.err;
  EXPECT_NE(pos.err.find("--seq-len 64 exceeds the model's 32 positions"), std::string::npos)
      << pos.err;
  EXPECT_EQ(pos.out.find("machine ("), std::string::npos) << "measured first: " << pos.out;
  // An --aio file with no "aio" block (a model's config.json by mistake) is refused, not read as
  // the defaults.
  const std::string model = tiny_model(d.path);
  const auto aio =
      testing::run(STRATA_PROF_BIN, with({"--aio", model, "--no-nvme"}), d.path, "aio");
  EXPECT_EQ(aio.status, 1) << aio.out << aio.err;
  EXPECT_NE(aio.err.find("--aio " + model + ": no \"aio\" block in it"), std::string::npos)
      << aio.err;
  EXPECT_NE(aio.err.find("strata-bench nvme --sweep --out"), std::string::npos) << aio.err;
  EXPECT_FALSE(fs::exists(d.path + "/best.json"));
  // A bare aio block (what parse_aio_config reads besides a ds_config) is one: the run goes on
  // to its next check (a pinned budget under 2 MiB, refused at once).
  std::ofstream(d.path + "/bare.json") << R"({"block_size": 1048576, "queue_depth": 32})";
  const auto bare =
      testing::run(STRATA_PROF_BIN,
                   with({"--aio", d.path + "/bare.json", "--no-nvme", "--host-mem-gb", "0.0001"}),
                   d.path, "bare");
  EXPECT_EQ(bare.status, 1) << bare.out << bare.err;
  EXPECT_NE(bare.err.find("--host-mem-gb"), std::string::npos) << bare.err;
}
#endif

}  // namespace
}  // namespace strata
