// The ZeRO-3 engine on one rank: placements, stages, memory caps, random delays, clipping
// and fp16 skipping against references, NVMe faults. Built twice: engine_test on the
// CPU-emulated device, engine_gpu_test (-DSTRATA_TEST_CUDA, label gpu) on CudaDevice, where
// it skips without a GPU.
#include <gtest/gtest.h>
#include <unistd.h>

#include <bit>
#include <filesystem>
#include <functional>
#include <future>
#include <map>
#include <thread>

#include "engine/linear_model.h"
#include "strata/adamw.h"
#include "strata/error.h"
#include "strata/trace.h"
#include "test_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using testing::LinearModel;
using namespace std::chrono_literals;

using testing::TempDir;

struct RunOut {
  std::vector<double> losses;
  std::vector<StepResult> results;
  std::vector<std::vector<float>> master;
  EngineStats stats;
  MemoryPlan plan;
  Isa isa = Isa::kAuto;               // Engine::host_optimizer_isa
  std::uint64_t eval_prefetches = 0;  // RunSetup::eval_every's passes
};

struct RunSetup {
  EngineConfig cfg = default_engine_config();
  HostDeviceOptions dev;
  int steps = 20;
  int accum = 1;
  float lr = 1e-2f;
  // Poisons the input of this (step, micro-batch) with an Inf, when >= 0 (and of every step after
  // it, when inf_stays).
  int inf_step = -1;
  bool inf_stays = false;
  // The lr of each step (null: `lr`), told to the engine before backward when announce_lr.
  std::function<float(int)> lr_of;
  bool announce_lr = true;
  // One more micro-batch than `accum` in this step, when >= 0.
  int extra_mb_step = -1;
  // After every `eval_every`-th step, two forward-only passes (fetch and release each unit in
  // the forward's order) under Engine::set_eval.
  int eval_every = 0;
};

#ifdef STRATA_TEST_CUDA
#define STRATA_NEEDS_DEVICE()                                                                     \
  do {                                                                                            \
    if (probe_cuda().device_count == 0) GTEST_SKIP() << "no usable GPU: " << probe_cuda().reason; \
  } while (0)
#define STRATA_EMULATED_ONLY() GTEST_SKIP() << "a property of the emulated device"
std::unique_ptr<Device> make_test_device(const HostDeviceOptions& o) {
  CudaDeviceOptions c;
  c.capacity_bytes = o.capacity_bytes;
  return make_cuda_device(c);
}
#else
#define STRATA_NEEDS_DEVICE() \
  do {                        \
  } while (0)
#define STRATA_EMULATED_ONLY() \
  do {                         \
  } while (0)
std::unique_ptr<Device> make_test_device(const HostDeviceOptions& o) { return make_host_device(o); }
#endif

// One rank: the device, a local communicator, an engine with `model` registered and finalized,
// and the model's compute stream.
struct Rig {
  std::unique_ptr<Device> dev;
  std::unique_ptr<Communicator> comm;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<Stream> stream;
  Rig(const HostDeviceOptions& d, const EngineConfig& cfg, const LinearModel& model)
      : dev(make_test_device(d)) {
    CommOptions co;
    // The GPU check runs these with CudaDevice and NCCL (one rank): the default
    // backend on a CUDA device; the local one on the emulated device.
    if (dev->kind() != DeviceKind::kCuda) co.backend = CommBackend::kLocal;
    comm = make_communicator(*dev, co);
    EXPECT_EQ(comm->backend(),
              dev->kind() == DeviceKind::kCuda ? CommBackend::kNccl : CommBackend::kLocal);
    engine = std::make_unique<Engine>(*dev, *comm, cfg);
    model.register_units(*engine);
    engine->finalize();
    stream = dev->create_stream("compute");
  }
  // Forward and backward of micro-batch `mb` of the model's data.
  double micro_batch(const LinearModel& model, int mb) {
    return model.micro_batch(*engine, *dev, *stream,
                             LinearModel::data(model.dims.front(), model.batch, 0, mb, 1),
                             LinearModel::data(model.dims.back(), model.batch, 0, mb, 2));
  }
};

RunOut train(const RunSetup& su, const LinearModel& model) {
  EngineConfig cfg = su.cfg;
  cfg.gradient_accumulation_steps = su.accum;
  Rig rig(su.dev, cfg, model);
  Engine& e = *rig.engine;
  Device* dev = rig.dev.get();
  Stream* s = rig.stream.get();
  RunOut out;
  const int B = model.batch;
  for (int step = 0; step < su.steps; ++step) {
    const float lr = su.lr_of ? su.lr_of(step) : su.lr;
    if (su.announce_lr) e.set_next_lr(lr);
    double loss = 0;
    const int mbs = su.accum + (step == su.extra_mb_step ? 1 : 0);
    for (int a = 0; a < mbs; ++a) {
      const int mb = step * su.accum + a;
      auto x = LinearModel::data(model.dims.front(), B, 0, mb, 1);
      auto t = LinearModel::data(model.dims.back(), B, 0, mb, 2);
      if (step == su.inf_step || (su.inf_stays && su.inf_step >= 0 && step > su.inf_step))
        x[3] = INFINITY;
      loss += model.micro_batch(e, *dev, *s, x, t) / su.accum;
    }
    out.losses.push_back(loss);
    out.results.push_back(e.step(lr));
    if (su.eval_every > 0 && (step + 1) % su.eval_every == 0) {
      const std::uint64_t before = e.stats().prefetches;
      e.set_eval(true);
      for (int pass = 0; pass < 2; ++pass)
        for (int l = 0; l < model.layers(); ++l) {
          e.fetch(l, *s);
          e.release(l, *s);
        }
      e.set_eval(false);
      out.eval_prefetches += e.stats().prefetches - before;
    }
  }
  for (int l = 0; l < model.layers(); ++l) out.master.push_back(e.gather_master(l));
  out.stats = e.stats();
  out.plan = e.plan();
  out.isa = e.host_optimizer_isa();
  return out;
}

void expect_identical(const RunOut& a, const RunOut& b, const char* what) {
  ASSERT_EQ(a.losses.size(), b.losses.size()) << what;
  for (std::size_t i = 0; i < a.losses.size(); ++i)  // bit for bit (a NaN loss equals itself)
    EXPECT_EQ(std::bit_cast<std::uint64_t>(a.losses[i]), std::bit_cast<std::uint64_t>(b.losses[i]))
        << what << " step " << i << ": " << a.losses[i] << " vs " << b.losses[i];
  ASSERT_EQ(a.master.size(), b.master.size());
  for (std::size_t l = 0; l < a.master.size(); ++l)
    EXPECT_TRUE(a.master[l] == b.master[l])
        << what << ": master weights of layer " << l << " differ";
}

Placement on(Tier t) {
  Placement p;
  p.device_fraction = t == Tier::kDevice ? 1 : 0;
  p.host_fraction = t == Tier::kHost ? 1 : 0;
  return p;
}

class PlacementTest : public ::testing::TestWithParam<DType> {};

TEST_P(PlacementTest, OffloadToHostOrNvmeIsBitIdenticalToNoOffload) {
  STRATA_NEEDS_DEVICE();
  const LinearModel model({24, 40, 33, 16}, 4, 11);
  RunSetup base;
  base.cfg.compute_dtype = GetParam();
  base.cfg.host_budget_bytes = 256 << 20;
  // No unit kept resident for its size (the default threshold, 100,000 elements, keeps every
  // unit of this small model): offloaded weights are fetched from their tier at each use.
  base.cfg.param_persistence_threshold = 0;
  const RunOut ref = train(base, model);
  EXPECT_LT(ref.losses.back(), ref.losses.front()) << "the model did not train";

  RunSetup host = base;
  host.cfg.params = on(Tier::kHost);
  host.cfg.optimizer = on(Tier::kHost);
  host.cfg.grads = on(Tier::kHost);
  const RunOut h = train(host, model);
  expect_identical(ref, h, "params+optimizer on host");
  // Each step brings every unit's new weights from the host (3 units, 20 steps), fetched or
  // prefetched.
  EXPECT_GE(h.stats.fetches + h.stats.prefetches, 3u * 20u)
      << "the weights were not fetched from the host";

  TempDir nv;
  RunSetup nvme = base;
  nvme.cfg.params = on(Tier::kNvme);
  nvme.cfg.optimizer = on(Tier::kNvme);
  nvme.cfg.grads = on(Tier::kHost);
  nvme.cfg.param_nvme_paths = {nv.path};
  nvme.cfg.optimizer_nvme_paths = {nv.path};
  const RunOut n = train(nvme, model);
  expect_identical(ref, n, "params+optimizer on NVMe");
  EXPECT_GE(n.stats.fetches + n.stats.prefetches, 3u * 20u)
      << "the weights were not fetched from NVMe";
  EXPECT_GT(n.stats.nvme_read_bytes, 0u);
  EXPECT_GT(n.stats.nvme_written_bytes, 0u);

  // Every piece split, unit by unit (3 equal shards, placed in order): weights device | host,
  // host; gradients device, device | host; optimizer device | host, host. Then with NVMe:
  // each of the three device | host | NVMe.
  RunSetup split = base;
  split.cfg.params = Placement{0.3, 0.7};
  split.cfg.grads = Placement{0.5, 0.5};
  split.cfg.optimizer = Placement{0.3, 0.7};
  expect_identical(ref, train(split, model), "every piece split between device and host");
  // With the early optimizer step: it takes the units whose gradients are on the host (here the
  // last one), the others are stepped in step().
  split.cfg.overlap_optimizer = true;
  const RunOut early = train(split, model);
  expect_identical(ref, early, "every piece split, early optimizer step");
  EXPECT_GT(early.stats.early_units_kept, 0u);
  split.cfg.overlap_optimizer = std::nullopt;
  split.cfg.params = Placement{0.3, 0.3};
  split.cfg.optimizer = Placement{0.3, 0.3};
  split.cfg.grads = Placement{0.3, 0.3};
  split.cfg.param_nvme_paths = {nv.path};
  split.cfg.optimizer_nvme_paths = {nv.path};
  split.cfg.grad_nvme_paths = {nv.path};
  const RunOut three = train(split, model);
  expect_identical(ref, three, "every piece split over the tiers");
  EXPECT_GT(three.stats.nvme_read_bytes, 0u);
  EXPECT_EQ(three.stats.nvme_bytes, three.plan.nvme_bytes) << three.plan.table();

  RunSetup mixed = base;  // optimizer 30% host, the rest NVMe; weights on the device
  mixed.cfg.optimizer.device_fraction = 0;
  mixed.cfg.optimizer.host_fraction = 0.3;
  mixed.cfg.grads = on(Tier::kHost);
  mixed.cfg.optimizer_nvme_paths = {nv.path};
  expect_identical(ref, train(mixed, model), "optimizer 30% host / 70% NVMe");
}

INSTANTIATE_TEST_SUITE_P(Dtypes, PlacementTest, ::testing::Values(DType::kF32, DType::kBF16),
                         [](const auto& p) { return std::string(dtype_name(p.param)); });

// strata.host_budget_bytes left at 0 means 80% of RAM (one rank here), for the plan and the
// pinned pool alike: an engine with host-tier state was refused ("host: needs ..., has 0 B").
TEST(Engine, AHostBudgetOfZeroIsTheDefaultBudget) {
  STRATA_NEEDS_DEVICE();
  const LinearModel model({24, 40, 33, 16}, 4, 5);
  RunSetup su;
  su.steps = 2;
  su.cfg.params = on(Tier::kHost);
  su.cfg.optimizer = on(Tier::kHost);
  su.cfg.grads = on(Tier::kHost);
  ASSERT_EQ(su.cfg.host_budget_bytes, 0u);
  const RunOut r = train(su, model);
  EXPECT_EQ(r.plan.host_capacity, default_host_budget(1));
  EXPECT_EQ(r.stats.host_budget_bytes, default_host_budget(1));
  EXPECT_GT(r.plan.host_bytes, 0u);
}

TEST(Engine, ClippedGradientsOnHostOrDeviceAreBitIdentical) {
  STRATA_NEEDS_DEVICE();
  const LinearModel model({24, 40, 33, 16}, 4, 17);
  RunSetup base;
  base.steps = 6;
  base.accum = 2;
  base.cfg.compute_dtype = DType::kBF16;
  base.cfg.gradient_clipping = 0.05;  // active every step: the norm decides the update
  base.cfg.host_budget_bytes = 64 << 20;
  const RunOut dev = train(base, model);
  EXPECT_LT(dev.results[0].clip_coef, 1.0) << "the test must actually clip";
  RunSetup host = base;
  host.cfg.grads = on(Tier::kHost);
  host.cfg.optimizer = on(Tier::kHost);
  expect_identical(dev, train(host, model), "clipped, gradients and optimizer on host");
}

// A model whose kernels write every element of its gradients may take them unzeroed
// (GradInit::kOverwrite): the same bits, with the units' padding (a unit of 960 elements pads
// to 2048) still zero under the emulated device's NaN poison, or the clipped norm would show it.
TEST(Engine, OverwrittenGradientBuffersGiveTheZeroedResultBitForBit) {
  STRATA_NEEDS_DEVICE();
  LinearModel model({24, 40, 33, 16}, 4, 17);
  RunSetup base;
  base.steps = 6;
  base.cfg.compute_dtype = DType::kBF16;
  base.cfg.gradient_clipping = 0.05;
  base.cfg.host_budget_bytes = 64 << 20;
  ASSERT_TRUE(base.dev.poison);
  for (Tier t : {Tier::kDevice, Tier::kHost}) {
    RunSetup s = base;
    s.cfg.grads = on(t);
    s.cfg.optimizer = on(t);
    model.grad_init = GradInit::kZeroed;
    const RunOut zeroed = train(s, model);
    EXPECT_LT(zeroed.results[0].clip_coef, 1.0) << "the test must actually clip";
    model.grad_init = GradInit::kOverwrite;
    const RunOut over = train(s, model);
    expect_identical(
        zeroed, over,
        t == Tier::kDevice ? "overwritten, on the device" : "overwritten, on the host");
    for (std::size_t i = 0; i < over.results.size(); ++i)
      EXPECT_EQ(zeroed.results[i].grad_norm, over.results[i].grad_norm) << "step " << i;
  }
}

// The device optimizer's new weights go back to host (or NVMe) memory on their own stream,
// behind the step: the next forward's fetch of each unit waits for its own write-back, and
// the copy-out scratch is not handed on while that copy still reads it. Equal-sized layers (so
// the allocator could hand one unit's scratch to the next) and random stream delays.
TEST(Engine, WeightsWrittenBackByTheDeviceOptimizerAreBitIdentical) {
  STRATA_NEEDS_DEVICE();
  STRATA_EMULATED_ONLY();
  const LinearModel model(std::vector<int>(9, 64), 4, 23);  // 8 layers of 64 x 64
  RunSetup base;
  base.steps = 6;
  base.cfg.compute_dtype = DType::kBF16;
  base.cfg.host_budget_bytes = 64 << 20;
  base.cfg.param_persistence_threshold = 0;  // no unit stays gathered
  const RunOut ref = train(base, model);
  TempDir nv;
  for (Tier t : {Tier::kHost, Tier::kNvme}) {
    RunSetup s = base;
    s.cfg.params = on(t);
    s.cfg.param_nvme_paths = {nv.path};
    s.dev.random_delay_us = 300;
    s.dev.seed = 5;
    const RunOut r = train(s, model);
    expect_identical(ref, r,
                     t == Tier::kHost ? "weights on host, optimizer on the device"
                                      : "weights on NVMe, optimizer on the device");
    EXPECT_GT(r.stats.d2h_bytes, 0u);
  }
}

TEST(Engine, Stages123AreBitIdentical) {
  STRATA_NEEDS_DEVICE();
  const LinearModel model({24, 40, 16}, 4, 5);
  RunSetup s3;
  s3.steps = 8;
  s3.cfg.compute_dtype = DType::kBF16;
  s3.cfg.host_budget_bytes = 64 << 20;
  const RunOut a = train(s3, model);
  for (int stage : {1, 2}) {
    RunSetup s = s3;
    s.cfg.stage = stage;
    expect_identical(a, train(s, model), stage == 1 ? "stage 1" : "stage 2");
  }
  // Stage 3 proper on one rank: no unit resident, each gathered from the host at every use
  // (on one rank, device-placed weights stay resident whatever the stage; the ranks' gathers
  // are engine_mpi_test's).
  RunSetup g = s3;
  g.cfg.param_persistence_threshold = 0;
  g.cfg.params = on(Tier::kHost);
  const RunOut b = train(g, model);
  expect_identical(a, b, "stage 3, weights fetched from the host");
  EXPECT_GE(b.stats.fetches + b.stats.prefetches, 2u * 8u);
}

TEST(Engine, RandomDelaysChangeNothing) {
  STRATA_NEEDS_DEVICE();
  STRATA_EMULATED_ONLY();
  const LinearModel model({24, 40, 33, 16}, 4, 12);
  TempDir nv;
  RunSetup s;
  s.steps = 6;
  s.cfg.compute_dtype = DType::kBF16;
  s.cfg.host_budget_bytes = 64 << 20;
  s.cfg.params = on(Tier::kNvme);
  s.cfg.optimizer = on(Tier::kHost);
  s.cfg.grads = on(Tier::kHost);
  s.cfg.param_nvme_paths = {nv.path};
  s.cfg.param_persistence_threshold = 0;  // every unit fetched from NVMe at every use
  const RunOut a = train(s, model);
  RunSetup d = s;
  d.dev.random_delay_us = 200;
  d.dev.seed = 99;
  const RunOut b = train(d, model);
  expect_identical(a, b, "random delays");
  EXPECT_GE(b.stats.fetches + b.stats.prefetches, 3u * 6u);
  EXPECT_GT(b.stats.prefetches, 0u);
  // Gradients on NVMe, two micro-batches (read back and added to) in buckets: the comm stream's
  // writes and reads and the optimizer's reads of them, delayed.
  RunSetup g = s;
  g.accum = 2;
  g.cfg.grads = on(Tier::kNvme);
  g.cfg.grad_nvme_paths = {nv.path};
  g.cfg.reduce_bucket_size = 2048;
  RunSetup gh = g;
  gh.cfg.grads = on(Tier::kHost);
  const RunOut c = train(gh, model);
  g.dev = d.dev;
  expect_identical(c, train(g, model), "random delays, gradients on NVMe");
}

// stage3_max_reuse_distance and the live budget decide what a released unit costs: 4 units of
// one shard each (2048 elements), weights on the host, forward 0 1 2 3 then backward 3 2 1 0.
// Each step fetches every unit once for the forward (the step changed them); then, with a
// reuse distance of 0 the backward gathers 0, 1 and 2 again (3 is used next at once); with
// 4096 (two units between uses) unit 2 is kept too; with the default, all are. With room for
// 3 units live, fetching unit 3 evicts the one whose next use is furthest away, unit 0: one
// more gather a step. Bits the same every way.
TEST(Engine, ReuseDistanceAndTheLiveBudgetDecideWhatIsGatheredAgain) {
  STRATA_NEEDS_DEVICE();
  const LinearModel model({32, 32, 32, 32, 32}, 2, 17);  // 4 units of 1,024 weights + 32 biases
  RunSetup su;
  su.steps = 6;
  su.cfg.host_budget_bytes = 64 << 20;
  su.cfg.params = on(Tier::kHost);
  su.cfg.param_persistence_threshold = 0;
  su.cfg.prefetch_bucket_size = 0;  // no prefetch: every gather is a fetch, in the order of use
  auto per_step = [&](const RunSetup& r, const char* what) {
    RunSetup one = r, two = r;
    one.steps = 3;  // the count over the last 3 steps: recorded order known, steady
    const RunOut a = train(one, model), b = train(two, model);
    expect_identical(train(su, model), b, what);
    return double(b.stats.fetches + b.stats.prefetches - a.stats.fetches - a.stats.prefetches) / 3;
  };
  RunSetup r = su;
  EXPECT_EQ(per_step(r, "default reuse distance"), 4.0);
  r.cfg.max_reuse_distance = 0;
  EXPECT_EQ(per_step(r, "reuse distance 0"), 7.0);
  r.cfg.max_reuse_distance = 4096;
  EXPECT_EQ(per_step(r, "reuse distance 4096"), 6.0);
  r = su;
  r.cfg.max_live_parameters = 3 * 2048;
  EXPECT_EQ(per_step(r, "3 units live"), 5.0);
}

// A change of the units' order (here a forward-only pass in another order, outside set_eval)
// is said in a log line and recorded again; prefetching resumes once the training order is
// back, and the results are those of a run without it.
TEST(Engine, AChangeOfOrderIsRecordedAgainWithALogLine) {
  STRATA_NEEDS_DEVICE();
  const LinearModel model({24, 40, 33, 16}, 4, 13);
  RunSetup su;
  su.steps = 8;
  su.cfg.host_budget_bytes = 64 << 20;
  su.cfg.params = on(Tier::kHost);
  su.cfg.param_persistence_threshold = 0;
  const RunOut ref = train(su, model);

  Rig rig(su.dev, su.cfg, model);
  Engine& e = *rig.engine;
  std::vector<double> losses;
  auto step = [&](int i) {
    e.set_next_lr(su.lr);
    losses.push_back(rig.micro_batch(model, i));
    e.step(su.lr);
  };
  for (int i = 0; i < 3; ++i) step(i);
  EXPECT_EQ(e.stats().trace_rebuilds, 0u);
  const std::uint64_t prefetched = e.stats().prefetches;
  EXPECT_GT(prefetched, 0u);
  ::testing::internal::CaptureStderr();
  for (int l : {2, 0, 1}) {
    e.fetch(l, *rig.stream);
    e.release(l, *rig.stream);
  }
  rig.stream->synchronize();
  const std::string said = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(e.stats().trace_rebuilds, 1u);
  EXPECT_NE(said.find("engine: unit order changed at position 0 (expected"), std::string::npos)
      << said;
  EXPECT_NE(said.find("recording it again"), std::string::npos) << said;
  // The pass belongs to the step after it: that step's order (the pass's, then the step's) is
  // recorded, the step after it differs again and is recorded; from then on it repeats.
  for (int i = 3; i < 8; ++i) step(i);
  EXPECT_EQ(e.stats().trace_rebuilds, 2u);
  EXPECT_GE(e.stats().prefetches, prefetched + 6) << "prefetching did not resume";
  ASSERT_EQ(losses.size(), ref.losses.size());
  for (std::size_t i = 0; i < losses.size(); ++i)
    EXPECT_EQ(std::bit_cast<std::uint64_t>(losses[i]), std::bit_cast<std::uint64_t>(ref.losses[i]))
        << "step " << i;
}

// Forward-only passes between steps (an evaluation) under set_eval: prefetched along the
// forward part of the recorded order, the order left as it was (each evaluation made it be
// recorded again twice, with a log line each: the next training step ran unprefetched), and
// the training's bits unchanged.
TEST(Engine, EvaluationPassesFollowTheForwardAndLeaveTheOrderAlone) {
  STRATA_NEEDS_DEVICE();
  std::vector<int> dims(9, 64);  // 8 layers
  const LinearModel model(dims, 2, 5);
  TempDir nv;
  RunSetup s;
  s.steps = 6;
  s.cfg.params = on(Tier::kNvme);
  s.cfg.param_nvme_paths = {nv.path};
  s.cfg.max_live_parameters = 2 * 4096;
  s.cfg.prefetch_bucket_size = 4096;
  s.cfg.param_persistence_threshold = 0;
  s.cfg.host_budget_bytes = 16 << 20;
  const RunOut plain = train(s, model);
  s.eval_every = 2;
  const RunOut evaluated = train(s, model);
  expect_identical(plain, evaluated, "with evaluation passes");
  EXPECT_EQ(evaluated.stats.trace_rebuilds, 0u);
  // 3 evaluations x 2 passes x 8 units, each prefetched when the order is followed — a pass's first
  // unit too, from set_eval(true) and from the end of the pass before (it was not: 36 of 48) —
  // and after the last pass the first unit again, which the next training step takes first.
  EXPECT_EQ(evaluated.eval_prefetches, 3u * (2 * 8 + 1))
      << "the evaluation passes were not prefetched";
  EXPECT_EQ(evaluated.stats.prefetches - evaluated.eval_prefetches, plain.stats.prefetches);
}

TEST(Engine, PeakDeviceBytesStayUnderACapFourTimesSmallerThanTheWeights) {
  STRATA_NEEDS_DEVICE();
  std::vector<int> dims(65, 128);  // 64 layers of 128 x 128
  const LinearModel model(dims, 2, 21);
  TempDir nv;
  RunSetup s;
  s.steps = 3;
  s.cfg.compute_dtype = DType::kBF16;
  s.cfg.params = on(Tier::kNvme);
  s.cfg.optimizer = on(Tier::kNvme);
  s.cfg.grads = on(Tier::kHost);
  s.cfg.param_nvme_paths = {nv.path};
  s.cfg.optimizer_nvme_paths = {nv.path};
  s.cfg.max_live_parameters = 2 * 16384;
  s.cfg.prefetch_bucket_size = 16384;
  s.cfg.param_persistence_threshold = 0;
  s.cfg.sub_group_size = 16384;      // the optimizer streams one layer's state at a time
  s.cfg.reduce_bucket_size = 16384;  // gradients reduce one layer at a time
  s.cfg.host_budget_bytes = 16 << 20;
  const std::size_t weights_bf16 = 64 * 128 * 128 * 2;
  s.dev.capacity_bytes = weights_bf16 / 4;
  const RunOut capped = train(s, model);
  EXPECT_LE(capped.stats.device_peak_bytes, s.dev.capacity_bytes);
  EXPECT_GE(weights_bf16, 4 * capped.stats.device_capacity);
  EXPECT_LE(capped.stats.host_pinned_peak_bytes, s.cfg.host_budget_bytes);
  // ... and within the memory plan's host lines: the engine takes no pinned byte the plan does
  // not list (the pool commits in 2 MiB steps: one step of slack).
  EXPECT_LE(capped.stats.host_pinned_peak_bytes, capped.plan.host_bytes + (std::uint64_t(2) << 20))
      << capped.plan.table();
  EXPECT_GT(capped.stats.prefetches, 0u) << "nothing was prefetched";
  EXPECT_EQ(capped.stats.trace_rebuilds, 0u);
  RunSetup roomy = s;
  roomy.dev.capacity_bytes = std::size_t(256) << 20;
  roomy.cfg.max_live_parameters = 1'000'000'000;
  expect_identical(capped, train(roomy, model), "capped vs roomy device");
}

// Pinned staging is bounded as the plan says even when everything could be gathered at once
// and the host runs far ahead of the streams: 16 layers of 512 x 512, weights on NVMe with two
// swap buffers, gradients and optimizer state on the host, no live-parameter limit.
TEST(Engine, PinnedStagingStaysWithinThePlan) {
  STRATA_NEEDS_DEVICE();
  std::vector<int> dims(17, 512);
  const LinearModel model(dims, 4, 5);
  TempDir nv;
  RunSetup s;
  s.steps = 2;
  s.cfg.compute_dtype = DType::kBF16;
  s.cfg.params = on(Tier::kNvme);
  s.cfg.optimizer = on(Tier::kHost);
  s.cfg.grads = on(Tier::kHost);
  s.cfg.param_nvme_paths = {nv.path};
  s.cfg.param_buffer_count = 2;
  s.cfg.param_persistence_threshold = 0;
  s.cfg.host_budget_bytes = 256 << 20;
  s.dev.h2d_gbps = 2;  // a link slower than the host: fetches queue up behind it
  s.dev.d2h_gbps = 2;
  const RunOut r = train(s, model);
  EXPECT_LE(r.stats.host_pinned_peak_bytes, r.plan.host_bytes + (std::uint64_t(2) << 20))
      << r.plan.table();
}

// The engine's NVMe files hold what the plan's NVMe lines say, to the byte, with units small
// enough to persist among the offloaded ones: a persistent unit has no compute-weight shard,
// and the offloaded units are split between host and NVMe by their own bytes only (one rule,
// scheduler/layout.h; the planner used to place the persistent units' shards as well, which
// moved the host/NVMe boundary and counted bytes the engine never writes).
TEST(Engine, NvmeFilesHoldWhatThePlanSaysWithPersistentUnits) {
  STRATA_NEEDS_DEVICE();
  const LinearModel model({8, 300, 300, 300, 8}, 4, 9);  // units of 2400, 90000, 90000, 2400
  TempDir nv;
  for (const bool early : {false, true}) {
    RunSetup s;
    s.steps = 2;
    s.cfg.compute_dtype = DType::kBF16;
    s.cfg.params.device_fraction = 0;
    s.cfg.params.host_fraction = 0.5;  // the first offloaded unit on the host, the other on NVMe
    s.cfg.optimizer = on(Tier::kNvme);
    s.cfg.grads = on(Tier::kHost);
    s.cfg.param_nvme_paths = {nv.path};
    s.cfg.optimizer_nvme_paths = {nv.path};
    s.cfg.param_persistence_threshold = 5000;  // the first and last units persist
    s.cfg.overlap_optimizer = early;
    s.cfg.host_budget_bytes = 256 << 20;
    const RunOut r = train(s, model);
    EXPECT_EQ(r.plan.early_optimizer_step, early) << r.plan.table();
    EXPECT_EQ(r.stats.nvme_bytes, r.plan.nvme_bytes) << "early step " << early << "\n"
                                                     << r.plan.table();
    EXPECT_LE(r.stats.host_pinned_peak_bytes, r.plan.host_bytes + (std::uint64_t(2) << 20))
        << r.plan.table();
  }
}

// A host budget of the plan's host lines (to the pool's 2 MiB step) is enough to place the state
// with two sub-groups' writes in flight and to train, with the bits of a roomy budget.
TEST(Engine, AHostBudgetAtThePlanIsEnoughToPlaceAndTrain) {
  STRATA_NEEDS_DEVICE();
  std::vector<int> dims(17, 256);  // 16 layers of 256 x 256
  const LinearModel model(dims, 2, 23);
  TempDir nv;
  RunSetup s;
  s.steps = 2;
  s.cfg.compute_dtype = DType::kBF16;
  s.cfg.params = on(Tier::kNvme);
  s.cfg.optimizer = on(Tier::kNvme);
  s.cfg.grads = on(Tier::kHost);
  s.cfg.param_nvme_paths = {nv.path};
  s.cfg.optimizer_nvme_paths = {nv.path};
  s.cfg.param_persistence_threshold = 0;
  s.cfg.sub_group_size = 65536;  // one layer's state a sub-group
  s.cfg.host_budget_bytes = std::size_t(256) << 20;
  const RunOut roomy = train(s, model);
  RunSetup tight = s;
  const std::uint64_t step = std::uint64_t(2) << 20;
  tight.cfg.host_budget_bytes = (roomy.plan.host_bytes + step - 1) / step * step;
  const RunOut r = train(tight, model);
  EXPECT_LE(r.stats.host_pinned_peak_bytes, tight.cfg.host_budget_bytes) << r.plan.table();
  expect_identical(roomy, r, "a host budget at the plan vs a roomy one");
}

// Work the compute stream queues on a unit after its last reduce_grad but before release()
// (the header: the unit is in use until the work queued before release() completes). A
// resident unit's weights are rewritten in place by step() — the optimizer's copy-out, or the
// fetch stream's switch to a kept early result — and must not be before that read.
TEST(Engine, StepWaitsForComputeReadsQueuedBeforeRelease) {
  STRATA_NEEDS_DEVICE();
  struct Case {
    Tier params, optimizer;
    bool resident, early;
  };
  for (const Case c :
       {Case{Tier::kHost, Tier::kHost, false, false},  // gathered: drop() waits already
        Case{Tier::kDevice, Tier::kDevice, true, false},
        Case{Tier::kDevice, Tier::kHost, true, false},
        Case{Tier::kDevice, Tier::kHost, true, true}}) {
    const std::string what =
        fmt::format("params {}, optimizer {}, resident {}, early step {}", tier_name(c.params),
                    tier_name(c.optimizer), c.resident, c.early);
    const LinearModel model({24, 40, 33, 16}, 4, 7);
    EngineConfig cfg = default_engine_config();
    cfg.compute_dtype = DType::kF32;
    cfg.params = on(c.params);
    cfg.optimizer = on(c.optimizer);
    cfg.grads = on(Tier::kHost);
    cfg.overlap_optimizer = c.early;
    cfg.host_budget_bytes = 64 << 20;
    if (!c.resident) cfg.param_persistence_threshold = 0;
    Rig rig(HostDeviceOptions{}, cfg, model);
    Engine& e = *rig.engine;
    Stream* s = rig.stream.get();
    for (int step = 0; step < 2; ++step) {  // the first records the order the early step follows
      rig.micro_batch(model, step);
      e.step(1e-2f);
    }
    const std::size_t n0 = e.unit_numel(0);
    std::vector<float> before(n0), seen(n0, -1.0f);
    {
      TensorRef w = e.fetch(0, *s);
      s->copy(host_ref(before.data(), n0 * 4), w.mem);
      e.release(0, *s);
      s->synchronize();
    }
    for (int l = model.layers() - 1; l >= 0; --l) {
      TensorRef w = e.fetch(l, *s);
      TensorRef g = e.grad_buffer(l, *s);
      s->fill(g, 0.01f);
      e.reduce_grad(l, *s);
      if (l == 0) {  // a read of unit 0's weights behind a slow op, after its reduce_grad
        s->host_fn([] { std::this_thread::sleep_for(std::chrono::milliseconds(300)); }, "slow");
        s->copy(host_ref(seen.data(), n0 * 4), w.mem);
      }
      e.release(l, *s);
    }
    e.step(1e-2f);
    s->synchronize();
    EXPECT_TRUE(seen == before)
        << what << ": the compute stream read unit 0's weights after step() rewrote them";
    if (c.early) {
      EXPECT_GT(e.stats().early_units_kept, 0u) << what;
    }
  }
}

// The unit gradients alive are the plan's: with overlap_comm (the stage-3 default) the next
// unit's backward runs beside the last one's queued reduce (two alive), and grad_buffer waits
// before a third; without, a unit's gradient buffer is made only once the last unit's reduce has
// finished (one). The first reduce is held up behind a slow op on the compute stream, so the
// host meets it queued whatever the timing: with four units both settings wait, and the
// device's peak stays within the plan's device total (which the stream-ordered frees would
// otherwise overrun: a host running ahead holds a gradient per queued backward).
TEST(Engine, UnitGradientsAliveAreThoseThePlanCounts) {
  STRATA_NEEDS_DEVICE();
  const LinearModel model({64, 256, 256, 256, 64}, 4, 7);
  std::size_t in_use[2] = {};
  std::uint64_t waits[2] = {};
  std::vector<float> weights[2];
  for (const bool overlap : {true, false}) {
    EngineConfig cfg = default_engine_config();
    cfg.compute_dtype = DType::kF32;
    cfg.overlap_comm = overlap;
    Rig rig(HostDeviceOptions{}, cfg, model);
    Engine& e = *rig.engine;
    Stream* s = rig.stream.get();
    s->synchronize();
    rig.dev->reset_peak_stats();
    for (int l = model.layers() - 1; l >= 0; --l) {
      TensorRef w = e.fetch(l, *s);
      (void)w;
      TensorRef g = e.grad_buffer(l, *s);
      if (l == model.layers() - 2) in_use[overlap] = rig.dev->stats().bytes_in_use;
      s->fill(g, 0.01f * float(l + 1));
      if (l == model.layers() - 1)
        s->host_fn([] { std::this_thread::sleep_for(std::chrono::milliseconds(300)); }, "slow");
      e.reduce_grad(l, *s);
      e.release(l, *s);
    }
    e.step(1e-2f);
    s->synchronize();
    EXPECT_LE(rig.dev->stats().peak_bytes_in_use, e.plan().device_bytes)
        << "overlap_comm " << overlap << ": the device's peak past the plan's total\n"
        << e.plan().table();
    waits[overlap] = e.stats().grad_waits;
    weights[overlap] = e.master_shard(0);
  }
  const std::size_t last_grad =
      model.dims[model.dims.size() - 2] * model.dims.back() * 4;  // the first unit reduced
  EXPECT_GE(in_use[true], in_use[false] + last_grad)
      << "with overlap_comm " << in_use[true] << " bytes in use, "
      << "without " << in_use[false];
  EXPECT_GE(waits[true], 1u) << "the third unit's gradient made beside two queued reduces";
  EXPECT_GE(waits[false], 1u);
  EXPECT_EQ(weights[true], weights[false]) << "the same step either way";
}

// An fp16 overflow skips the step; the next forward still follows the recorded order.
TEST(Engine, OverflowSkippedStepKeepsThePrefetchTrace) {
  STRATA_NEEDS_DEVICE();
  const LinearModel model({24, 40, 33, 16}, 4, 31);
  RunSetup f;
  f.steps = 6;
  f.cfg.compute_dtype = DType::kF16;
  f.cfg.fp16.enabled = true;
  f.cfg.fp16.initial_scale_power = 8;
  f.cfg.fp16.hysteresis = 1;
  f.cfg.params = on(Tier::kHost);
  f.cfg.optimizer = on(Tier::kHost);
  f.cfg.grads = on(Tier::kHost);
  f.cfg.param_persistence_threshold = 0;
  f.cfg.host_budget_bytes = 64 << 20;
  f.inf_step = 3;
  const RunOut r = train(f, model);
  ASSERT_TRUE(r.results[3].skipped);
  EXPECT_EQ(r.stats.trace_rebuilds, 0u) << "the skipped step left the trace position at its end";
}

// fp16 whose gradients overflow every step: the scale halves (after the hysteresis) down to
// fp16.min_loss_scale, and an overflow there ends the run with what to do, as DeepSpeed's
// raise_error_at_min_scale does (every step went on being skipped without a word).
TEST(Engine, Fp16OverflowAtTheLeastLossScaleEndsTheRun) {
  STRATA_NEEDS_DEVICE();
  const LinearModel model({24, 40, 16}, 4, 31);
  RunSetup f;
  f.cfg.compute_dtype = DType::kF16;
  f.cfg.fp16.enabled = true;
  f.cfg.fp16.initial_scale_power = 4;
  f.cfg.fp16.hysteresis = 2;
  f.cfg.fp16.min_loss_scale = 1;
  f.cfg.params = on(Tier::kHost);
  f.cfg.optimizer = on(Tier::kHost);
  f.cfg.grads = on(Tier::kHost);
  f.cfg.host_budget_bytes = 64 << 20;
  f.inf_step = 0;
  f.inf_stays = true;
  f.steps = 5;
  const RunOut r = train(f, model);
  std::vector<double> scales;
  for (const StepResult& s : r.results) {
    EXPECT_TRUE(s.skipped);
    scales.push_back(s.loss_scale);
  }
  EXPECT_EQ(scales, (std::vector<double>{16, 16, 8, 4, 2}));
  f.steps = 8;
  testing::expect_error([&] { train(f, model); },
                        {"fp16: the gradients overflowed at the least loss scale "
                         "(fp16.min_loss_scale 1), after 0 updates",
                         "train in bf16"});
  // Above the least scale it goes on.
  f.cfg.fp16.min_loss_scale = 0.25;
  f.steps = 7;
  EXPECT_EQ(train(f, model).results.back().loss_scale, 0.5);
}

// The linear model's loss and gradients in double on the host.
struct Reference {
  std::vector<std::vector<double>> w;  // per layer [out, in]
  std::vector<int> dims;
  double loss_and_grads(const std::vector<float>& x, const std::vector<float>& t, int B,
                        std::vector<std::vector<double>>* g) const {
    const int L = int(dims.size()) - 1;
    std::vector<std::vector<double>> h(std::size_t(L) + 1);
    h[0].assign(x.begin(), x.end());
    for (int l = 0; l < L; ++l) {
      const int in = dims[std::size_t(l)], out = dims[std::size_t(l) + 1];
      h[std::size_t(l) + 1].assign(std::size_t(B) * out, 0.0);
      for (int b = 0; b < B; ++b)
        for (int o = 0; o < out; ++o)
          for (int i = 0; i < in; ++i)
            h[std::size_t(l) + 1][std::size_t(b * out + o)] +=
                h[std::size_t(l)][std::size_t(b * in + i)] *
                w[std::size_t(l)][std::size_t(o * in + i)];
    }
    const int outL = dims.back();
    std::vector<double> dy(std::size_t(B) * outL);
    double loss = 0;
    for (std::size_t i = 0; i < dy.size(); ++i) {
      const double d = h[std::size_t(L)][i] - t[i];
      loss += 0.5 * d * d / B;
      dy[i] = d / B;
    }
    g->assign(std::size_t(L), {});
    for (int l = L - 1; l >= 0; --l) {
      const int in = dims[std::size_t(l)], out = dims[std::size_t(l) + 1];
      auto& gl = (*g)[std::size_t(l)];
      gl.assign(std::size_t(out) * in, 0.0);
      std::vector<double> dh(std::size_t(B) * in, 0.0);
      for (int b = 0; b < B; ++b)
        for (int o = 0; o < out; ++o)
          for (int i = 0; i < in; ++i) {
            gl[std::size_t(o * in + i)] +=
                dy[std::size_t(b * out + o)] * h[std::size_t(l)][std::size_t(b * in + i)];
            dh[std::size_t(b * in + i)] +=
                dy[std::size_t(b * out + o)] * w[std::size_t(l)][std::size_t(o * in + i)];
          }
      dy = std::move(dh);
    }
    return loss;
  }
};

TEST(Engine, GradientClippingAgreesWithASerialReference) {
  STRATA_NEEDS_DEVICE();
  const LinearModel model({24, 40, 16}, 4, 8);
  RunSetup s;
  s.steps = 1;
  s.lr = 0.05f;
  s.cfg.gradient_clipping = 0.05;
  s.cfg.optimizer = on(Tier::kHost);
  s.cfg.grads = on(Tier::kHost);
  s.cfg.host_budget_bytes = 64 << 20;
  const RunOut r = train(s, model);

  Reference ref;
  ref.dims = model.dims;
  for (auto& w : model.init) ref.w.emplace_back(w.begin(), w.end());
  std::vector<std::vector<double>> g;
  const double loss = ref.loss_and_grads(LinearModel::data(24, 4, 0, 0, 1),
                                         LinearModel::data(16, 4, 0, 0, 2), 4, &g);
  double sq = 0;
  for (auto& gl : g)
    for (double v : gl) sq += v * v;
  const double norm = std::sqrt(sq);
  ASSERT_GT(norm, s.cfg.gradient_clipping) << "the test must actually clip";
  EXPECT_NEAR(r.losses[0], loss, 1e-5 * loss);
  EXPECT_NEAR(r.results[0].grad_norm, norm, 1e-5 * norm);
  const double coef = s.cfg.gradient_clipping / (norm + 1e-6);
  EXPECT_NEAR(r.results[0].clip_coef, coef, 1e-5 * coef);
  // One AdamW step (t = 1, decoupled decay 0) on the clipped gradient, in double.
  const AdamWOptions o = s.cfg.adamw;
  for (std::size_t l = 0; l < g.size(); ++l) {
    for (std::size_t i = 0; i < g[l].size(); ++i) {
      const double gi = g[l][i] * coef;
      const double m = (1 - o.beta1) * gi, v = (1 - o.beta2) * gi * gi;
      const double mhat = m / (1 - o.beta1), vhat = v / (1 - o.beta2);
      const double want = ref.w[l][i] - s.lr * mhat / (std::sqrt(vhat) + o.eps);
      ASSERT_NEAR(r.master[l][i], want, 1e-5 + 1e-4 * std::fabs(s.lr))
          << "layer " << l << " element " << i;
    }
  }
}

TEST(Engine, Fp16OverflowSkipsTheStepAndHalvesTheScale) {
  STRATA_NEEDS_DEVICE();
  const LinearModel model({24, 40, 16}, 4, 9);
  RunSetup s;
  s.steps = 4;
  s.inf_step = 1;
  s.cfg.compute_dtype = DType::kF16;
  s.cfg.fp16.enabled = true;
  s.cfg.fp16.initial_scale_power = 8;
  s.cfg.fp16.hysteresis = 1;
  s.cfg.fp16.loss_scale_window = 1000;
  s.cfg.host_budget_bytes = 64 << 20;
  const RunOut r = train(s, model);
  EXPECT_FALSE(r.results[0].skipped);
  EXPECT_TRUE(r.results[1].skipped);
  EXPECT_FALSE(r.results[2].skipped);
  EXPECT_EQ(r.results[0].loss_scale, 256.0);
  EXPECT_EQ(r.results[1].loss_scale, 256.0);
  EXPECT_EQ(r.results[2].loss_scale, 128.0);
  EXPECT_EQ(r.results[3].step, 3);
  // The skipped step changed nothing: the same run without the bad batch and one step fewer
  // (steps 0, 2, 3 with the same data) must match bit for bit... except the scale, which is
  // part of the math: compare with a run whose first overflow-free steps match instead.
  RunSetup clean = s;
  clean.inf_step = -1;
  clean.steps = 1;
  const RunOut c = train(clean, model);
  EXPECT_EQ(r.losses[0], c.losses[0]);
}

// Trains `s` on another thread: the run must end within 60 s in a strata::Error, whose text
// is returned ("" once a failure is reported: a hang, or no error at all).
std::string error_of_train(const RunSetup& s, const LinearModel& model, const char* fault) {
  auto fut = std::async(std::launch::async, [&] { return train(s, model); });
  if (fut.wait_for(60s) != std::future_status::ready) {
    ADD_FAILURE() << "the engine hung on " << fault;
    return "";
  }
  try {
    fut.get();
    ADD_FAILURE() << fault << " was swallowed";
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// One step with the optimizer state on NVMe in `nv` and the gradients on the host.
RunSetup optimizer_on_nvme(const TempDir& nv) {
  RunSetup s;
  s.steps = 1;
  s.cfg.optimizer = on(Tier::kNvme);
  s.cfg.grads = on(Tier::kHost);
  s.cfg.optimizer_nvme_paths = {nv.path};
  s.cfg.host_budget_bytes = 64 << 20;
  return s;
}

TEST(Engine, EnospcDuringSwapOutIsAClearErrorNotAHang) {
  STRATA_NEEDS_DEVICE();
  const LinearModel model({24, 40, 33, 16}, 4, 13);
  TempDir nv;
  RunSetup s = optimizer_on_nvme(nv);
  // Chunks: 3 state writes at start-up (0-2), then step 1 reads ahead and writes behind:
  // read 3, read 4, write 5 (layer 0), read 6, write 7 (layer 1): fail the second write.
  s.cfg.aio.inject_faults = {{FaultKind::kEnospc, 7}};
  const std::string w = error_of_train(s, model, "ENOSPC");
  EXPECT_NE(w.find("disk is full"), std::string::npos) << w;
  EXPECT_NE(w.find("swap key 'o1.0'"), std::string::npos) << w;  // unit 1, sub-group 0
}

// Placing the first state writes a few sub-groups at a time while the next are made: a write
// that fails there (the first unit's, found only once later ones are under way; or a slow one
// the next waits for) still ends the start in its error, naming its key, and a slow write delays
// the start without changing a bit of what is placed.
TEST(Engine, AWriteFailingWhileTheStateIsPlacedIsItsError) {
  STRATA_NEEDS_DEVICE();
  const LinearModel model({24, 40, 33, 16}, 4, 13);
  for (const std::uint64_t chunk : {0, 1, 2}) {
    TempDir nv;
    RunSetup s = optimizer_on_nvme(nv);
    s.cfg.aio.inject_faults = {{FaultKind::kEio, chunk}};
    const std::string w = error_of_train(s, model, "EIO at start-up");
    EXPECT_NE(w.find(fmt::format("swap key 'o{}.0'", chunk)), std::string::npos)
        << "chunk " << chunk << ": " << w;
  }
  TempDir a, b;
  RunSetup s = optimizer_on_nvme(a);
  s.steps = 2;
  const RunOut fast = train(s, model);
  s.cfg.optimizer_nvme_paths = {b.path};
  s.cfg.aio.inject_faults = {{FaultKind::kDelay, 0, 200}};
  const RunOut slow = train(s, model);
  EXPECT_EQ(fast.losses, slow.losses);
  EXPECT_EQ(fast.master, slow.master);
  // A budget with room for the plan's lines and no more: placed all the same.
  TempDir c;
  s.cfg.optimizer_nvme_paths = {c.path};
  s.cfg.aio.inject_faults.clear();
  s.cfg.host_budget_bytes = (fast.plan.host_bytes + (2 << 20) - 1) / (2 << 20) * (2 << 20);
  const RunOut tight = train(s, model);
  EXPECT_EQ(fast.master, tight.master);
}

// The early optimizer step (strata.overlap_optimizer): each unit's host AdamW runs as soon as
// its last gradient of the step is in, into a second copy of the state; step() keeps it when
// the step is the one it assumed. Kept or redone, the bits are the serial step's.
RunSetup early_setup(const TempDir& nv, Tier optimizer) {
  RunSetup s;
  s.steps = 8;
  s.cfg.compute_dtype = DType::kBF16;
  s.cfg.host_budget_bytes = 64 << 20;
  s.cfg.params = on(optimizer);  // weights beside the optimizer state
  s.cfg.optimizer = on(optimizer);
  s.cfg.grads = on(Tier::kHost);
  s.cfg.param_nvme_paths = {nv.path};
  s.cfg.optimizer_nvme_paths = {nv.path};
  s.cfg.overlap_optimizer = true;  // the emulated device's default is off: it shares the cores
  return s;
}

// The early step with its state on NVMe, new weights to the device, and one I/O fault.
RunSetup early_nvme_with(const TempDir& nv, const Fault& fault) {
  RunSetup s = early_setup(nv, Tier::kNvme);
  s.cfg.params = on(Tier::kDevice);
  s.cfg.aio.inject_faults = {fault};
  return s;
}

RunSetup without_early(RunSetup s) {
  s.cfg.overlap_optimizer = false;
  return s;
}

// The host optimizer's work is traced under names of its own, the spans strata-prof puts on the
// cpu lane (beside the model's): AdamW, the gradients' sums of squares and, with fp32 weights (no
// copy-out from the kernel), the updated weights copied out; with the early step and without.
TEST(Engine, TheHostOptimizersWorkIsTracedForTheCpuLane) {
  STRATA_NEEDS_DEVICE();
  const LinearModel model({24, 40, 33, 16}, 4, 37);  // 3 units
  TempDir nv;
  for (const bool early : {false, true}) {
    RunSetup host = early_setup(nv, Tier::kHost);
    host.steps = 3;
    host.cfg.compute_dtype = DType::kF32;
    host.cfg.gradient_clipping = 1.0;  // a norm every step
    host.cfg.overlap_optimizer = early;
    host.cfg.device_grad_norm = false;  // the host's sums (a GPU's default takes them there)
    Tracer& tracer = Tracer::global();
    tracer.clear();
    tracer.set_enabled(true);
    train(host, model);
    tracer.set_enabled(false);
    std::map<std::string, int> n;
    for (const TraceSpan& sp : tracer.spans())
      if (sp.lane == "optimizer") ++n[sp.name];
    tracer.clear();
    SCOPED_TRACE(early ? "early step" : "serial step");
    EXPECT_GE(n["cpu_adamw"], 3 * host.steps);
    EXPECT_GE(n["cpu_copy_w"], 3 * host.steps);
    EXPECT_GE(n["cpu_sum_squares"], 3 * host.steps);
    EXPECT_EQ(n["sum_squares"], 0) << "a host sum under the device's span name";
  }
}

// strata.device_grad_norm (the default on a GPU; off on the emulated device unless set): a
// host-tier gradient that arrives whole in one reduce_grad has its part of the norm taken on
// the device, beside its copy: no CPU pass over it after the first (recording) step, with the
// early step and without, and the bits (clipping every step) are those of gradients kept on
// the device. With two micro-batches the host accumulates, and the host takes the norm.
TEST(Engine, AWholeHostGradientsNormIsTakenOnTheDevice) {
  STRATA_NEEDS_DEVICE();
  const LinearModel model({24, 40, 33, 16}, 4, 37);  // 3 units
  TempDir nv;
  for (const int accum : {1, 2}) {
    RunSetup dev;
    dev.steps = 4;
    dev.accum = accum;
    dev.cfg.compute_dtype = DType::kBF16;
    dev.cfg.gradient_clipping =
        accum == 1 ? 0.0 : 0.05;  // the early work kept (no clipping) / clips every step
    dev.cfg.host_budget_bytes = 64 << 20;
    const RunOut ref = train(dev, model);
    for (const bool early : {false, true})
      for (const bool device_norm : {false, true}) {
        RunSetup host = early_setup(nv, Tier::kHost);
        host.cfg.device_grad_norm = device_norm;
        host.steps = dev.steps;
        host.accum = accum;
        host.cfg.gradient_clipping = dev.cfg.gradient_clipping;
        host.cfg.params = on(Tier::kDevice);  // the optimizer state on the host: the early worker's
        host.cfg.overlap_optimizer = early;
        Tracer& tracer = Tracer::global();
        tracer.clear();
        tracer.set_enabled(true);
        const RunOut r = train(host, model);
        tracer.set_enabled(false);
        int cpu_passes = 0;  // the host's sums (the device's are "sum_squares" on its streams)
        for (const TraceSpan& sp : tracer.spans())
          cpu_passes += sp.name == "cpu_sum_squares" && sp.lane == "optimizer";
        tracer.clear();
        const std::string what =
            fmt::format("accum {}, early step {}, device_grad_norm {}", accum, early, device_norm);
        expect_identical(ref, r, what.c_str());
        for (std::size_t i = 0; i < ref.results.size(); ++i)  // the norm itself, bit for bit
          EXPECT_EQ(std::bit_cast<std::uint64_t>(double(ref.results[i].grad_norm)),
                    std::bit_cast<std::uint64_t>(double(r.results[i].grad_norm)))
              << what << " step " << i;
        if (early && accum == 1) {
          EXPECT_GT(r.stats.early_units_kept, 0u) << what << ": the worker's path never ran";
        }
        if (accum == 1 && device_norm)
          EXPECT_EQ(cpu_passes, 3) << what << ": the first step's only";
        else  // every unit every step (a redone early step may take some twice)
          EXPECT_GE(cpu_passes, 3 * host.steps) << what;
      }
  }
}

TEST(Engine, EarlyOptimizerStepIsKeptAndBitIdentical) {
  STRATA_NEEDS_DEVICE();
  const LinearModel model({24, 40, 33, 16}, 4, 31);
  TempDir nv;
  for (Tier t : {Tier::kHost, Tier::kNvme}) {
    for (Tier w : {Tier::kDevice, t}) {  // new weights to the device, or to the optimizer's tier
      RunSetup s = early_setup(nv, t);
      s.cfg.params = on(w);
      const std::string what =
          fmt::format("optimizer on {}, weights on {}", tier_name(t), tier_name(w));
      const RunOut on_ = train(s, model);
      const RunOut off = train(without_early(s), model);
      EXPECT_TRUE(on_.plan.early_optimizer_step) << what << "\n" << on_.plan.table();
      EXPECT_FALSE(off.plan.early_optimizer_step) << what;
      EXPECT_NE(on_.plan.table().find("early optimizer step"), std::string::npos)
          << on_.plan.table();
      expect_identical(off, on_, what.c_str());
      // Step 1 records the gradients per unit; every later step keeps every unit's early work.
      EXPECT_EQ(on_.stats.early_units_kept, std::uint64_t(s.steps - 1) * 3) << what;
      EXPECT_EQ(on_.stats.early_units_redone, 0u) << what;
      EXPECT_EQ(off.stats.early_units_kept + off.stats.early_units_redone, 0u) << what;
      EXPECT_LE(on_.stats.host_pinned_peak_bytes, on_.plan.host_bytes + (std::uint64_t(2) << 20))
          << what << "\n"
          << on_.plan.table();
    }
  }
}

// zero_optimization.sub_group_size: the host optimizer steps each unit's shard a sub-group at a
// time and NVMe holds one key per sub-group, so the pinned buffers between them hold one
// sub-group's state instead of one unit's (a billion-element embedding no longer needs several
// 12 GB buffers). The bits do not change: early step or not, new weights to the device or the
// optimizer's tier, a unit's last sub-group shorter than the others.
TEST(Engine, SubGroupsGiveTheSameBitsInSmallerBuffers) {
  STRATA_NEEDS_DEVICE();
  const LinearModel model({64, 1000, 1000, 64}, 4, 41);  // shards of 65536, 1001472, 65536 elements
  TempDir nv;
  for (Tier t : {Tier::kHost, Tier::kNvme}) {
    for (Tier w : {Tier::kDevice, t}) {
      for (const bool early : {false, true}) {
        RunSetup whole = early_setup(nv, t);
        whole.steps = 5;
        whole.cfg.params = on(w);
        whole.cfg.param_persistence_threshold = 0;
        whole.cfg.overlap_optimizer = early;
        whole.cfg.host_budget_bytes = 256 << 20;  // whole, four 12 MB state buffers are planned
        RunSetup split = whole;
        split.cfg.sub_group_size =
            12288;  // 6 and 82 sub-groups, the last of each 4096 / 6144 elements
        const std::string what = fmt::format("optimizer on {}, weights on {}, early step {}",
                                             tier_name(t), tier_name(w), early);
        const RunOut a = train(whole, model), b = train(split, model);
        expect_identical(a, b, what.c_str());
        if (early) {
          EXPECT_EQ(b.stats.early_units_kept, std::uint64_t(split.steps - 1) * 3) << what;
        }
        EXPECT_LE(b.stats.host_pinned_peak_bytes, b.plan.host_bytes + (std::uint64_t(2) << 20))
            << what << "\n"
            << b.plan.table();
        if (t != Tier::kNvme) continue;
        // Four swap buffers (offload_optimizer.buffer_count) of one sub-group's state each.
        const auto swap = [](const MemoryPlan& p) {
          for (const PlanLine& l : p.lines)
            if (l.what.rfind("optimizer swap buffers", 0) == 0) return l.bytes;
          return std::uint64_t(0);
        };
        // One key a sub-group, packed: the files hold what the plan says, as with whole units.
        EXPECT_EQ(b.stats.nvme_bytes, b.plan.nvme_bytes) << what << "\n" << b.plan.table();
        EXPECT_EQ(swap(a.plan), 4u * 1001472 * 12) << a.plan.table();
        EXPECT_EQ(swap(b.plan), 4u * 12288 * 12) << b.plan.table();
        // Whole: at least one 12 MB state buffer beside the 4.5 MB of gradients; in sub-groups
        // the gradients and the new device weights (2 MB) are most of it.
        EXPECT_LT(b.stats.host_pinned_peak_bytes + (std::uint64_t(6) << 20),
                  a.stats.host_pinned_peak_bytes)
            << what << ": the pinned peak did not shrink";
      }
    }
  }
}

// Units whose master, m and v would lie a multiple of 64 MiB apart get gaps after them
// (layout.h's state_stride): two units of 8M elements (32 MiB an array, so v would be 64 MiB after
// master), the optimizer state of one on the host, of the other on NVMe. The same bits as with
// the state on the device; the NVMe files and the plan agree to the byte, gaps included; the
// plan says the gaps, 3 x 64 KiB a unit on each tier.
TEST(Engine, OptimizerStateWithGapsGivesTheSameBitsAndKeepsToThePlan) {
  STRATA_NEEDS_DEVICE();
  const LinearModel model({64, 131072, 64}, 4, 47);  // units of 8388608 elements
  TempDir nv;
  RunSetup dev;
  dev.steps = 3;
  dev.cfg.compute_dtype = DType::kBF16;
  const RunOut ref = train(dev, model);
  for (const bool early : {false, true}) {
    RunSetup s = dev;
    s.cfg.optimizer.device_fraction = 0;
    s.cfg.optimizer.host_fraction = 0.5;  // the first unit's on the host, the second's on NVMe
    s.cfg.grads = on(Tier::kHost);
    s.cfg.optimizer_nvme_paths = {nv.path};
    s.cfg.overlap_optimizer = early;
    s.cfg.host_budget_bytes = std::uint64_t(1) << 30;
    const RunOut r = train(s, model);
    const std::string what = fmt::format("early step {}", early);
    expect_identical(ref, r, what.c_str());
    EXPECT_EQ(r.plan.early_optimizer_step, early) << r.plan.table();
    std::uint64_t gaps[3] = {};
    for (const PlanLine& l : r.plan.lines)
      if (l.what.rfind("optimizer state: gaps", 0) == 0) gaps[static_cast<int>(l.tier)] += l.bytes;
    EXPECT_EQ(gaps[static_cast<int>(Tier::kHost)], 3u * 65536) << what << "\n" << r.plan.table();
    EXPECT_EQ(gaps[static_cast<int>(Tier::kNvme)], 3u * 65536) << what << "\n" << r.plan.table();
    EXPECT_EQ(r.stats.nvme_bytes, r.plan.nvme_bytes) << what << "\n" << r.plan.table();
    EXPECT_LE(r.stats.host_pinned_peak_bytes, r.plan.host_bytes + (std::uint64_t(2) << 20))
        << what << "\n"
        << r.plan.table();
  }
}

// zero_optimization.reduce_bucket_size: the reducer works each unit's gradient a bucket at a time
// (on one rank: the copy to the host and the accumulation; the reduce-scatter with more, in
// engine_mpi_test). Gradients on the device or the host, one micro-batch (the device takes
// the norm) or two (the host accumulates through its staging): the same bits as whole units.
TEST(Engine, GradientBucketsGiveTheSameBits) {
  STRATA_NEEDS_DEVICE();
  const LinearModel model({64, 1000, 1000, 64}, 4, 43);  // shards of 65536, 1001472, 65536 elements
  TempDir nv;
  for (Tier g : {Tier::kDevice, Tier::kHost}) {
    for (const int accum : {1, 2}) {
      RunSetup whole;
      whole.steps = 3;
      whole.accum = accum;
      whole.cfg.compute_dtype = DType::kBF16;
      whole.cfg.grads = on(g);
      whole.cfg.optimizer = on(g);  // host gradients feed the host optimizer
      whole.cfg.device_grad_norm = true;
      whole.cfg.gradient_clipping = 0.05;  // the norm decides every step
      whole.cfg.host_budget_bytes = 256 << 20;
      RunSetup split = whole;
      split.cfg.reduce_bucket_size =
          4096;  // 16, 245 and 16 buckets a gradient, the 245th half full
      const std::string what =
          fmt::format("gradients on {}, {} micro-batches", tier_name(g), accum);
      const RunOut a = train(whole, model), b = train(split, model);
      expect_identical(a, b, what.c_str());
      for (std::size_t i = 0; i < a.results.size(); ++i)
        EXPECT_EQ(a.results[i].grad_norm, b.results[i].grad_norm) << what << " step " << i;
      const std::uint64_t gradients = std::uint64_t(whole.steps * accum);
      EXPECT_EQ(a.stats.grad_buckets, gradients * 3) << what;
      EXPECT_EQ(b.stats.grad_buckets, gradients * (16 + 245 + 16)) << what;
      EXPECT_EQ(a.stats.d2h_bytes, b.stats.d2h_bytes) << what;
    }
  }
}

// Gradient shards on NVMe (zero_optimization.offload_grads "nvme"): written a bucket at a time
// as backward reduces them, read back and added to by the next micro-batch, their squares summed
// on the way out (the norm, hence clipping), read by the optimizer a sub-group at a time. Bit for
// bit the run without offload, beside every optimizer tier, with buckets (3 pages) and
// sub-groups (4 pages) that cut the shards in different places, two micro-batches and clipping.
class GradsOnNvmeTest : public ::testing::TestWithParam<DType> {};

TEST_P(GradsOnNvmeTest, GradientsOnNvmeAreBitIdenticalToNoOffload) {
  STRATA_NEEDS_DEVICE();
  const LinearModel model({96, 200, 160, 64}, 4, 29);  // shards of 20480, 32768, 10240 elements
  const std::uint64_t shards = 20480 + 32768 + 10240;
  TempDir nv;
  RunSetup base;
  base.steps = 5;
  base.accum = 2;
  base.cfg.compute_dtype = GetParam();
  base.cfg.gradient_clipping = 0.05;
  base.cfg.reduce_bucket_size = 6144;
  base.cfg.sub_group_size = 8192;
  base.cfg.param_persistence_threshold = 0;
  base.cfg.host_budget_bytes = 256 << 20;
  base.cfg.param_nvme_paths = {nv.path};
  base.cfg.optimizer_nvme_paths = {nv.path};
  base.cfg.grad_nvme_paths = {nv.path};
  // The NVMe traffic counted below is the gradients' alone: without the early optimizer step
  // (a GPU's default) in the gradients-on-host run, whose second copy of the NVMe compute
  // weights the run with gradients on NVMe does not make. The early step is the last case's.
  base.cfg.overlap_optimizer = false;
  const RunOut ref = train(base, model);
  EXPECT_LT(ref.results[0].clip_coef, 1.0) << "the test must actually clip";
  for (Tier o : {Tier::kDevice, Tier::kHost, Tier::kNvme}) {
    RunSetup host = base;  // the same, the gradients on the host: the NVMe traffic apart from them
    host.cfg.params = on(Tier::kNvme);
    host.cfg.optimizer = on(o);
    host.cfg.grads = on(Tier::kHost);
    RunSetup s = host;
    s.cfg.grads = on(Tier::kNvme);
    const std::string what = fmt::format("gradients on NVMe, optimizer on {}", tier_name(o));
    const RunOut h = train(host, model), r = train(s, model);
    expect_identical(ref, r, what.c_str());
    for (std::size_t i = 0; i < ref.results.size(); ++i)
      EXPECT_EQ(ref.results[i].grad_norm, r.results[i].grad_norm) << what << " step " << i;
    // Each micro-batch writes every gradient shard; the second reads it back first, the
    // optimizer once more.
    EXPECT_EQ(r.stats.nvme_written_bytes - h.stats.nvme_written_bytes, 5u * 2 * shards * 4) << what;
    EXPECT_EQ(r.stats.nvme_read_bytes - h.stats.nvme_read_bytes, 5u * 2 * shards * 4) << what;
    EXPECT_EQ(r.stats.nvme_bytes, r.plan.nvme_bytes) << what << "\n" << r.plan.table();
    EXPECT_LE(r.stats.host_pinned_peak_bytes, r.plan.host_bytes + (std::uint64_t(2) << 20))
        << what << "\n"
        << r.plan.table();
  }
  // Half on the host (the first units), half on NVMe, with the early step taking the host ones.
  RunSetup split = base;
  split.cfg.optimizer = on(Tier::kNvme);
  split.cfg.grads = Placement{0.0, 0.5};
  split.cfg.overlap_optimizer = true;
  split.cfg.gradient_clipping = 0;  // (the early results are kept only without clipping)
  RunSetup plain = base;
  plain.cfg.gradient_clipping = 0;
  const RunOut sr = train(split, model);
  expect_identical(train(plain, model), sr, "gradients half on the host, half on NVMe, early step");
  EXPECT_GT(sr.stats.early_units_kept, 0u);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, GradsOnNvmeTest, ::testing::Values(DType::kF32, DType::kBF16),
                         [](const auto& p) { return std::string(dtype_name(p.param)); });

// An fp16 overflow with the gradients on NVMe skips the step (its squares came with the writes)
// and the next step starts the keys afresh: the same bits as on the host.
TEST(Engine, Fp16OverflowWithGradientsOnNvmeSkipsAsOnTheHost) {
  STRATA_NEEDS_DEVICE();
  const LinearModel model({24, 40, 16}, 4, 9);
  TempDir nv;
  RunSetup s;
  s.steps = 4;
  s.accum = 2;
  s.inf_step = 1;
  s.cfg.compute_dtype = DType::kF16;
  s.cfg.fp16.enabled = true;
  s.cfg.fp16.initial_scale_power = 8;
  s.cfg.fp16.hysteresis = 1;
  s.cfg.host_budget_bytes = 64 << 20;
  s.cfg.optimizer = on(Tier::kNvme);
  s.cfg.grads = on(Tier::kHost);
  s.cfg.optimizer_nvme_paths = {nv.path};
  s.cfg.grad_nvme_paths = {nv.path};
  const RunOut host = train(s, model);
  ASSERT_TRUE(host.results[1].skipped);
  s.cfg.grads = on(Tier::kNvme);
  const RunOut r = train(s, model);
  expect_identical(host, r, "fp16 overflow, gradients on NVMe");
  for (std::size_t i = 0; i < r.results.size(); ++i) {
    EXPECT_EQ(r.results[i].skipped, host.results[i].skipped) << "step " << i;
    EXPECT_EQ(r.results[i].loss_scale, host.results[i].loss_scale) << "step " << i;
  }
}

// A full disk or a failed read on the gradients' way to or from NVMe: a clear error naming the
// key, the run stops, no hang.
TEST(Engine, AnIoErrorOnAnNvmeGradientIsAClearErrorNotAHang) {
  STRATA_NEEDS_DEVICE();
  const LinearModel model({24, 40, 33, 16}, 4, 13);
  TempDir nv;
  RunSetup s;
  s.steps = 2;
  s.accum = 2;
  s.cfg.optimizer = on(Tier::kHost);
  s.cfg.params = on(Tier::kNvme);
  s.cfg.param_nvme_paths = {nv.path};
  s.cfg.grad_nvme_paths = {nv.path};
  s.cfg.grads = on(Tier::kNvme);
  s.cfg.param_persistence_threshold = 1 << 30;  // every unit resident: the gradients' I/O only
  s.cfg.host_budget_bytes = 64 << 20;
  // The first I/O is the first backward's write of layer 2 (the comm stream writes 2, 1, 0; the
  // host's read-backs of the next micro-batch may come between them).
  s.cfg.aio.inject_faults = {{FaultKind::kEnospc, 0}};
  std::string w = error_of_train(s, model, "ENOSPC");
  EXPECT_NE(w.find("disk is full"), std::string::npos) << w;
  EXPECT_NE(w.find("write of"), std::string::npos) << w;
  EXPECT_NE(w.find("swap key 'g2@0'"), std::string::npos) << w;
  // Only layer 2's gradient on NVMe: its I/O in one order — written (0), read back (1) and
  // written (2) by the second micro-batch, read by the optimizer (3).
  s.cfg.grads = Placement{0.0, 0.6};
  for (const int chunk : {1, 3}) {
    s.cfg.aio.inject_faults = {{FaultKind::kEio, std::uint64_t(chunk)}};
    w = error_of_train(s, model, "EIO");
    EXPECT_NE(w.find("read of"), std::string::npos) << chunk << ": " << w;
    EXPECT_NE(w.find("swap key 'g2@0'"), std::string::npos) << chunk << ": " << w;
  }
}

// Gradients on the device, the optimizer on the host: step() stages each sub-group's gradient in
// pinned memory for the host AdamW, which the plan's D2H staging line must hold even when the
// reducer's buckets are far smaller than a sub-group (it planned two buckets' shares: 16 KiB).
TEST(Engine, DeviceGradientsStagedForTheHostOptimizerStayWithinThePlan) {
  STRATA_NEEDS_DEVICE();
  const LinearModel model({64, 1000, 1000, 64}, 4, 41);
  for (Tier w : {Tier::kDevice, Tier::kHost}) {
    RunSetup s;
    s.steps = 2;
    s.cfg.compute_dtype = DType::kBF16;
    s.cfg.params = on(w);
    s.cfg.grads = on(Tier::kDevice);
    s.cfg.optimizer = on(Tier::kHost);
    s.cfg.param_persistence_threshold = 0;
    s.cfg.reduce_bucket_size = 2048;
    s.cfg.host_budget_bytes = 256 << 20;
    const RunOut r = train(s, model);
    EXPECT_LE(r.stats.host_pinned_peak_bytes, r.plan.host_bytes + (std::uint64_t(2) << 20))
        << "weights on " << tier_name(w) << "\n"
        << r.plan.table();
  }
}

// strata.optimizer_isa picks the host AdamW's code path; every path gives the serial step's
// bits, early or not. A path this CPU lacks is refused when the engine is made, naming the key.
TEST(Engine, EveryOptimizerIsaGivesTheSameBits) {
  STRATA_NEEDS_DEVICE();
  const LinearModel model({24, 40, 33, 16}, 4, 35);
  TempDir nv;
  RunSetup s = early_setup(nv, Tier::kHost);
  s.steps = 4;
  const RunOut reference = train(without_early(s), model);
  EXPECT_EQ(reference.isa, adamw_selected_isa());
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    RunSetup t = s;
    t.cfg.optimizer_isa = isa;
    if (!isa_supported(isa)) {
      try {
        train(t, model);
        ADD_FAILURE() << isa_name(isa) << " ran on a CPU that lacks it";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("'strata.optimizer_isa'"), std::string::npos)
            << e.what();
      }
      continue;
    }
    const std::string what = fmt::format("optimizer_isa {}", isa_name(isa));
    const RunOut early = train(t, model);
    EXPECT_EQ(early.isa, isa) << what;
    EXPECT_GT(early.stats.early_units_kept, 0u) << what;
    expect_identical(reference, early, what.c_str());
    expect_identical(reference, train(without_early(t), model), (what + ", serial").c_str());
  }
}

TEST(Engine, EarlyOptimizerStepIsRedoneWhenTheStepClipsOverflowsOrChangesLr) {
  STRATA_NEEDS_DEVICE();
  const LinearModel model({24, 40, 33, 16}, 4, 32);
  TempDir nv;
  for (Tier t : {Tier::kHost, Tier::kNvme}) {
    RunSetup s = early_setup(nv, t);
    s.steps = 10;
    // Clip at the median gradient norm of an unclipped run: some steps clip, some do not.
    std::vector<double> norms;
    for (const StepResult& r : train(s, model).results) norms.push_back(r.grad_norm);
    std::nth_element(norms.begin(), norms.begin() + 5, norms.end());
    s.cfg.gradient_clipping = norms[5];
    // A warm-up lr, announced before backward except in steps 6 and 7.
    s.lr_of = [](int step) { return 1e-2f * float(step + 1) / 10; };
    s.extra_mb_step = 8;  // one more micro-batch than recorded: the early results are partial
    const RunOut on_ = train(s, model);
    expect_identical(train(without_early(s), model), on_, tier_name(t));
    EXPECT_GT(on_.stats.early_units_kept, 0u) << tier_name(t);
    EXPECT_GT(on_.stats.early_units_redone, 0u) << tier_name(t);
    int clipped = 0;
    for (const StepResult& r : on_.results) clipped += r.clip_coef < 1 ? 1 : 0;
    EXPECT_GT(clipped, 0);
    EXPECT_LT(clipped, s.steps);

    RunSetup unannounced = s;  // the lr changes every step and the engine is not told
    unannounced.cfg.gradient_clipping = 0;
    unannounced.announce_lr = false;
    unannounced.extra_mb_step = -1;
    const RunOut u = train(unannounced, model);
    expect_identical(train(without_early(unannounced), model), u, "lr not announced");
    EXPECT_EQ(u.stats.early_units_kept, 0u);
    // Attempts at steps 1, 3 and 6 (0-based), each redone; then it backs off 1, 2, 4 steps.
    EXPECT_EQ(u.stats.early_units_redone, 3u * 3);
    EXPECT_EQ(u.stats.early_steps_skipped, 1u + 2 + 3);
  }

  RunSetup f = early_setup(nv, Tier::kHost);  // fp16: an overflow skips the step
  f.cfg.compute_dtype = DType::kF16;
  f.cfg.fp16.enabled = true;
  f.cfg.fp16.initial_scale_power = 8;
  f.cfg.fp16.hysteresis = 1;
  f.inf_step = 3;
  const RunOut fo = train(f, model);
  EXPECT_TRUE(fo.results[3].skipped);
  expect_identical(train(without_early(f), model), fo, "fp16 overflow");
  EXPECT_GT(fo.stats.early_units_redone, 0u);
  EXPECT_GT(fo.stats.early_units_kept, 0u);
}

TEST(Engine, EarlyOptimizerStepDefaultsAndRefusal) {
  STRATA_NEEDS_DEVICE();
  std::vector<int> dims(9, 512);  // 8 layers of 512 x 512: 24 MiB of optimizer state
  const LinearModel model(dims, 2, 33);
  TempDir nv;
  RunSetup s = early_setup(nv, Tier::kHost);
  s.steps = 2;
  s.cfg.params = on(Tier::kDevice);
  s.cfg.overlap_optimizer.reset();     // strata decides
  s.cfg.host_budget_bytes = 48 << 20;  // 35 MiB planned without the second state copy, 63 with
  const RunOut r = train(s, model);
  EXPECT_FALSE(r.plan.early_optimizer_step) << r.plan.table();
#ifdef STRATA_TEST_CUDA
  // On a GPU it would be on, but its second copy does not fit: off, said in a note.
  ASSERT_EQ(r.plan.notes.size(), 1u) << r.plan.table();
  EXPECT_NE(r.plan.notes[0].find("strata.overlap_optimizer is off"), std::string::npos)
      << r.plan.notes[0];
#else
  EXPECT_TRUE(r.plan.notes.empty())
      << r.plan.table();  // off for the emulated device, before planning
#endif
  EXPECT_EQ(r.stats.early_units_kept + r.stats.early_units_redone, 0u);
  s.cfg.overlap_optimizer = true;  // asked for explicitly: refused, with what to change
  try {
    train(s, model);
    FAIL() << "an explicit overlap_optimizer that cannot fit was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kOutOfMemory);
    EXPECT_NE(std::string(e.what()).find("strata.overlap_optimizer false"), std::string::npos)
        << e.what();
  }
}

// step() does not wait for kept early work: what the worker has not done yet is finished
// behind, each unit before its next fetch. Holding the early step's first NVMe read for
// 300 ms keeps the worker busy past the end of backward, so step() must return with work
// still queued; the bits are still the serial step's.
TEST(Engine, KeptEarlyWorkFinishesBehindTheStepBitIdentically) {
  STRATA_NEEDS_DEVICE();
  const LinearModel model({24, 40, 33, 16}, 4, 35);
  TempDir nv;
  for (Tier w : {Tier::kDevice, Tier::kNvme}) {
    RunSetup s = early_setup(nv, Tier::kNvme);
    s.steps = 4;
    s.cfg.params = on(w);
    // Start-up writes 3 chunks of state, step 1 reads 3 and writes 3 (0-8), with the weights
    // on NVMe 3 more each; step 2's first chunk is then the early step's first state read.
    const std::uint64_t first_early = w == Tier::kDevice ? 9 : 15;
    // (held 1 s: the step must end while it is held, on two busy cores under ASan too)
    s.cfg.aio.inject_faults = {{FaultKind::kDelay, first_early, 1000}};
    const std::string what = fmt::format("weights on {}", tier_name(w));
    Tracer& tracer = Tracer::global();
    tracer.clear();
    tracer.set_enabled(true);
    const RunOut on_ = train(s, model);
    tracer.set_enabled(false);
    // The held read was waited for by the next forward's fetch, not by step().
    std::int64_t longest_wait_ns = 0;
    for (const TraceSpan& sp : tracer.spans())
      if (sp.name == "optimizer_wait")
        longest_wait_ns = std::max(longest_wait_ns, sp.end_ns - sp.start_ns);
    tracer.clear();
    EXPECT_GT(longest_wait_ns, 100'000'000) << what << ": no fetch waited for the held early work";
    RunSetup serial = without_early(s);
    serial.cfg.aio.inject_faults.clear();
    expect_identical(train(serial, model), on_, what.c_str());
    EXPECT_EQ(on_.stats.early_units_kept, std::uint64_t(s.steps - 1) * 3) << what;
    EXPECT_GE(on_.stats.early_units_finished_behind, 2u) << what;
  }
}

// The new weights of kept early work reach the device in the order the next forward uses
// them. The forward's first unit is the last to get its gradient, so it is often the one the
// worker has not finished when step() ends: the units after it, done already, used to be
// copied first, and the forward's first fetch waited for all of their copies on the fetch
// stream. Its unit here is by far the largest, so it is still being stepped then.
TEST(Engine, KeptEarlyWeightsReachTheDeviceInTheForwardsOrder) {
  STRATA_NEEDS_DEVICE();
  const LinearModel model({2048, 2048, 24, 256, 32}, 4, 38);
  TempDir nv;
  RunSetup s = early_setup(nv, Tier::kHost);
  s.steps = 8;  // 7 steps whose first unit may be unfinished when step() ends (the old order: 20 in
                // 20 runs caught)
  s.cfg.params = on(Tier::kDevice);  // resident: nothing but these copies on the fetch stream
  s.cfg.host_budget_bytes = 256 << 20;
  std::map<std::uint64_t, int> unit_of_bytes;  // each unit's bf16 weights: a size of its own
  for (int l = 0; l < model.layers(); ++l)
    unit_of_bytes[std::uint64_t(model.dims[std::size_t(l)]) *
                  std::uint64_t(model.dims[std::size_t(l) + 1]) * 2] = l;
  ASSERT_EQ(unit_of_bytes.size(), std::size_t(model.layers()));
  Rig rig(s.dev, s.cfg, model);
  Tracer& tracer = Tracer::global();
  tracer.clear();
  tracer.set_enabled(true);
  for (int step = 0; step < s.steps; ++step) {
    rig.engine->set_next_lr(s.lr);
    rig.micro_batch(model, step);
    rig.engine->step(s.lr);
  }
  rig.micro_batch(model, s.steps);  // the last step's new weights are switched by the next forward
  rig.dev->synchronize();
  tracer.set_enabled(false);
  std::vector<TraceSpan> copies;
  for (const TraceSpan& sp : tracer.spans())
    if (sp.lane == "fetch" && sp.name == "copy_h2d" && unit_of_bytes.count(sp.bytes))
      copies.push_back(sp);
  tracer.clear();
  std::stable_sort(copies.begin(), copies.end(),
                   [](const TraceSpan& a, const TraceSpan& b) { return a.start_ns < b.start_ns; });
  std::string order;
  for (const TraceSpan& sp : copies) order += std::to_string(unit_of_bytes[sp.bytes]);
  EXPECT_EQ(rig.engine->stats().early_units_kept, std::uint64_t(s.steps - 1) * 4);
  // Steps 2-8 keep every unit's early work; each step's new weights go up in layer order.
  std::string expected;
  for (int i = 1; i < s.steps; ++i) expected += "0123";
  EXPECT_EQ(order, expected);
}

// An engine destroyed right after step(), its kept early work still queued behind a held
// NVMe read: the destructor lets the worker's job and its I/O settle, and nothing is read or
// written after it is gone (ASan runs this too).
TEST(Engine, DestroyedWithKeptWorkBehindTheStepEndsCleanly) {
  STRATA_NEEDS_DEVICE();
  const LinearModel model({24, 40, 33, 16}, 4, 36);
  TempDir nv;
  // step 2's first early read, held 1 s: the step ends while it is held, however busy the cores
  const RunSetup s = early_nvme_with(nv, {FaultKind::kDelay, 9, 1000});
  Rig rig(s.dev, s.cfg, model);
  for (int step = 0; step < 2; ++step) {
    rig.micro_batch(model, step);
    rig.engine->step(s.lr);
  }
  EXPECT_GE(rig.engine->stats().early_units_finished_behind, 2u);
  rig.engine.reset();
  rig.dev->synchronize();
}

TEST(Engine, AnIoErrorInTheEarlyStepIsAClearErrorNotAHang) {
  STRATA_NEEDS_DEVICE();
  const LinearModel model({24, 40, 33, 16}, 4, 34);
  TempDir nv;
  // Start-up writes 3 chunks, step 1 reads 3 and writes 3 (chunks 0-8); step 2's I/O is the
  // early step's: reads of the current state and writes of the second copy.
  RunSetup s = early_nvme_with(nv, {FaultKind::kEio, 10});
  s.steps = 3;
  const std::string w = error_of_train(s, model, "an I/O error");
  EXPECT_NE(w.find("swap key 'o"), std::string::npos) << w;
}

// ... and once the worker has failed, whatever needs the state it left throws that error again
// (the engine used to throw an internal check on the second call).
TEST(Engine, AfterAnEarlyStepIoErrorTheStateThrowsThatErrorAgain) {
  STRATA_NEEDS_DEVICE();
  const LinearModel model({24, 40, 33, 16}, 4, 34);
  TempDir nv;
  const RunSetup su = early_nvme_with(nv, {FaultKind::kEio, 10});
  Rig rig(su.dev, su.cfg, model);
  Engine& e = *rig.engine;
  std::string first;
  for (int step = 0; step < 3 && first.empty(); ++step) {
    try {
      e.set_next_lr(su.lr);
      rig.micro_batch(model, step);
      e.step(su.lr);
    } catch (const Error& x) {
      first = x.what();
    }
  }
  ASSERT_NE(first.find("swap key 'o"), std::string::npos) << first;
  for (int l = 0; l < model.layers(); ++l) {
    try {
      e.master_shard(l);
    } catch (const Error& x) {
      EXPECT_EQ(std::string(x.what()), first) << "layer " << l;
    }
  }
  try {
    e.step(su.lr);
    ADD_FAILURE() << "a step after the worker failed went through";
  } catch (const Error& x) {
    EXPECT_EQ(std::string(x.what()), first);
  }
}

TEST(Engine, AnImpossiblePlanIsRefusedBeforeAnythingIsAllocated) {
  STRATA_NEEDS_DEVICE();
  const LinearModel model({128, 128, 128}, 4, 3);
  RunSetup s;
  s.cfg.stage = 2;  // every unit's weights resident on the device
  s.dev.capacity_bytes = 16 << 10;
  try {
    train(s, model);
    FAIL() << "a plan that cannot fit was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kOutOfMemory);
    const std::string what = e.what();
    EXPECT_NE(what.find("the training state does not fit:\n  device: needs "), std::string::npos)
        << what;
    // The table follows, without saying the problem again (it was said twice).
    EXPECT_EQ(what.find("device: needs ", what.find("device: needs ") + 1), std::string::npos)
        << what;
    EXPECT_NE(what.find("verdict: does not fit"), std::string::npos) << what;
  }
}

// strata.optimizer_threads beyond the process's cores is refused naming the key (the AdamW said
// it had that many threads and ran on the cores it had).
TEST(Engine, MoreOptimizerThreadsThanCoresNamesTheKey) {
  STRATA_NEEDS_DEVICE();
  const LinearModel model({64, 64}, 2, 3);
  RunSetup s;
  s.steps = 1;
  s.cfg.optimizer = on(Tier::kHost);
  s.cfg.grads = on(Tier::kHost);
  s.cfg.optimizer_threads = 4096;
  try {
    train(s, model);
    FAIL() << "4096 optimizer threads were accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find(
                  "config key 'strata.optimizer_threads' = 4096: oneTBB runs at most "),
              std::string::npos)
        << e.what();
  }
}

// Misuse is a clear error naming the call, never a crash or a std::out_of_range: a gradient
// before finalize() (reduce_grad used to dereference the comm stream it had not made yet:
// SIGSEGV), a master shard before finalize(), a unit the model never registered.
TEST(Engine, MisuseBeforeFinalizeOrOfAMissingUnitIsAClearError) {
  STRATA_NEEDS_DEVICE();
  const LinearModel model({64, 64, 64}, 2, 3);
  auto dev = make_test_device({});
  CommOptions co;
  co.backend = CommBackend::kLocal;
  auto comm = make_communicator(*dev, co);
  auto stream = dev->create_stream("compute");
  Engine e(*dev, *comm, default_engine_config());
  model.register_units(e);
  auto expect_error = [](const std::function<void()>& f, const std::string& words) {
    try {
      f();
      ADD_FAILURE() << "accepted; expected an error saying: " << words;
    } catch (const Error& x) {
      EXPECT_NE(std::string(x.what()).find(words), std::string::npos) << x.what();
    }
  };
  expect_error([&] { e.grad_buffer(0, *stream); }, "Engine::grad_buffer before finalize()");
  expect_error([&] { e.reduce_grad(0, *stream); }, "Engine::reduce_grad before finalize()");
  expect_error([&] { e.master_shard(0); }, "Engine::master_shard before finalize()");
  expect_error([&] { e.gather_master(0); }, "before finalize()");
  e.finalize();
  expect_error([&] { e.release(7, *stream); },
               "Engine::release: no unit 7 (the model registered 2)");
  expect_error([&] { e.grad_buffer(-1, *stream); }, "Engine::grad_buffer: no unit -1");
  expect_error([&] { e.reduce_grad(2, *stream); }, "Engine::reduce_grad: no unit 2");
  expect_error([&] { e.master_shard(9); }, "Engine::master_shard: no unit 9");
  expect_error([&] { e.gather_master(9); }, "no unit 9");
  expect_error([&] { e.unit_numel(5); }, "Engine::unit_numel: no unit 5 (the model registered 2)");
  expect_error([&] { e.param_offset(2, 0); }, "Engine::param_offset: no unit 2");
  expect_error([&] { e.param_offset(0, 1); },
               "Engine::param_offset: unit 'layer0' has no parameter 1 (it registered 1)");
  EXPECT_EQ(e.master_shard(1).size(), e.unit_numel(1));  // the engine is still usable
}

// Optimizer state on the device needs no pinned staging, which the plan does not count: with
// the host budget at the plan's host bytes, finalize() and load_state() fit (both staged every
// unit's master | m | v through a pinned block, and ran out of pinned memory).
TEST(Engine, DeviceOptimizerStateFitsAHostBudgetOfThePlansHostBytes) {
  STRATA_NEEDS_DEVICE();
  const LinearModel model({512, 512, 512, 512}, 4, 11);
  for (const Tier grads : {Tier::kHost, Tier::kDevice}) {
    SCOPED_TRACE(grads == Tier::kHost ? "grads on host" : "grads on device");
    RunSetup s;
    s.steps = 2;
    s.cfg.params = on(Tier::kHost);
    s.cfg.optimizer = on(Tier::kDevice);
    s.cfg.grads = on(grads);
    s.cfg.host_budget_bytes = std::uint64_t(1) << 30;
    const std::uint64_t planned = train(s, model).plan.host_bytes;
    s.cfg.host_budget_bytes = (planned + (std::uint64_t(2) << 20) - 1) / (std::uint64_t(2) << 20) *
                              (std::uint64_t(2) << 20);
    RunOut a;
    ASSERT_NO_THROW(a = train(s, model)) << "planned " << planned << " bytes of host memory";
    // And a checkpoint of it loads into an engine of the same budget, to the bit.
    TempDir ck;
    Rig r1(s.dev, s.cfg, model);
    r1.micro_batch(model, 0);
    r1.engine->step(s.lr);
    r1.engine->save_state(ck.path);
    Rig r2(s.dev, s.cfg, model);
    ASSERT_NO_THROW(r2.engine->load_state(ck.path));
    for (int l = 0; l < model.layers(); ++l)
      EXPECT_TRUE(r1.engine->master_shard(l) == r2.engine->master_shard(l)) << l;
  }
}

// offload_param.nvme_path "/nvme" beside offload_optimizer.nvme_path "/nvme/" (or a link to it)
// is one directory: one store serves both, as for identical spellings (two stores on it were
// refused: "in use by another running strata process").
TEST(Engine, OneDirectorySpelledTwoWaysIsOneSwapStore) {
  STRATA_NEEDS_DEVICE();
  const LinearModel model({256, 256, 256}, 4, 5);
  TempDir nv;
  fs::create_symlink(nv.path, nv.path + "-link");
  for (const std::string& other : {nv.path + "/", nv.path + "-link"}) {
    SCOPED_TRACE(other);
    RunSetup s;
    s.steps = 2;
    s.cfg.params = on(Tier::kNvme);
    s.cfg.optimizer = on(Tier::kNvme);
    s.cfg.grads = on(Tier::kHost);
    s.cfg.param_nvme_paths = {nv.path};
    s.cfg.optimizer_nvme_paths = {other};
    RunOut r;
    ASSERT_NO_THROW(r = train(s, model));
    EXPECT_GT(r.stats.nvme_written_bytes, 0u);
  }
  fs::remove(nv.path + "-link");
}

}  // namespace
}  // namespace strata
