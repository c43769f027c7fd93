// The engine across ranks: N ranks under mpirun (MPI on the CPU-emulated device), each with
// 1/N of the global batch, against one rank with the whole batch computed in the same
// process. Same global batch, so the same losses and weights up to reduction order.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "engine/linear_model.h"
#include "strata/error.h"
#include "strata/model.h"
#include "strata/trainer.h"
#include "test_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using testing::LinearModel;

using Env = testing::RankEnv;
Env* g_env = nullptr;

struct Run {
  std::vector<double> losses;  // global mean loss per step
  std::vector<std::vector<float>> master;
  std::uint64_t early_kept = 0;  // unit updates the early optimizer step kept
  std::uint64_t grad_buckets = 0, reduce_scatters = 0;
  std::uint64_t fetches = 0;  // fetched or prefetched
};

// Adam's eps is 1e-4 here, not 1e-8: AdamW's first update is lr * g / (|g| + eps), so with a tiny
// eps an element whose gradient nearly cancels (8 products summing to ~1e-8) moves by a visible
// amount for a last-bit change of its sum. N ranks and one rank sum a gradient in different orders
// (the GEMM library's blocking decides one of them, and oneDNN's AVX2 and AVX-512 kernels block
// differently), so the comparisons below would depend on the data's luck, not on the engine.
Run train(Device& dev, Communicator& comm, EngineConfig cfg, const LinearModel& model,
          int rows_per_rank, int steps, int accum) {
  cfg.gradient_accumulation_steps = accum;
  cfg.adamw.eps = 1e-4f;
  Engine e(dev, comm, cfg);
  model.register_units(e);
  e.finalize();
  auto s = dev.create_stream("compute");
  Run out;
  const int r = comm.rank(), n = comm.world_size();
  for (int step = 0; step < steps; ++step) {
    double loss = 0;
    for (int a = 0; a < accum; ++a) {
      const int mb = a;  // the same micro-batches every step: the loss must fall
      auto x = LinearModel::data(model.dims.front(), rows_per_rank, r * rows_per_rank, mb, 1);
      auto t = LinearModel::data(model.dims.back(), rows_per_rank, r * rows_per_rank, mb, 2);
      loss += model.micro_batch(e, dev, *s, x, t) / accum;
    }
    e.step(2e-2f);
    if (n > 1) {  // the global loss: the mean of the ranks' means (equal row counts)
      Buffer b = dev.alloc(8, s.get());
      s->copy(b.ref(), host_ref(&loss, 8));
      comm.all_reduce(TensorRef{b.ref(), DType::kF64, 1}, ReduceOp::kSum, *s);
      s->copy(host_ref(&loss, 8), b.ref());
      s->synchronize();
      loss /= n;
    }
    out.losses.push_back(loss);
  }
  for (int l = 0; l < model.layers(); ++l) out.master.push_back(e.gather_master(l));
  out.early_kept = e.stats().early_units_kept;
  out.grad_buckets = e.stats().grad_buckets;
  out.fetches = e.stats().fetches + e.stats().prefetches;
  out.reduce_scatters = e.stats().reduce_scatters;
  return out;
}

constexpr int kRows = 2, kSteps = 6, kAccum = 2;

// This job's ranks training `dims` (each kRows rows of every micro-batch).
Run train_ranks(EngineConfig cfg, const std::vector<int>& dims) {
  cfg.host_budget_bytes = 64 << 20;
  return train(*g_env->dev, *g_env->comm, cfg, LinearModel(dims, kRows, 7), kRows, kSteps, kAccum);
}

// Returns the ranks' run.
Run compare_with_one_rank(EngineConfig cfg, const char* what,
                          const std::vector<int>& dims = {24, 40, 33, 16}) {
  Env& env = *g_env;
  const int n = env.comm->world_size();
  const int rows = kRows, steps = kSteps, accum = kAccum;
  cfg.host_budget_bytes = 64 << 20;
  const Run multi = train_ranks(cfg, dims);

  auto dev1 = make_host_device();
  CommOptions co;
  co.backend = CommBackend::kLocal;
  co.process_local = true;
  auto local = make_communicator(*dev1, co);
  EngineConfig c1 = cfg;
  for (auto* paths : {&c1.param_nvme_paths, &c1.optimizer_nvme_paths, &c1.grad_nvme_paths})
    for (auto& p : *paths) p += "/reference-of-rank" + std::to_string(env.comm->rank());
  for (auto* paths : {&c1.param_nvme_paths, &c1.optimizer_nvme_paths, &c1.grad_nvme_paths})
    for (auto& p : *paths) fs::create_directories(p);
  const Run one = train(*dev1, *local, c1, LinearModel(dims, rows * n, 7), rows * n, steps, accum);

  for (int i = 0; i < steps; ++i)
    EXPECT_NEAR(multi.losses[std::size_t(i)], one.losses[std::size_t(i)],
                1e-5 * one.losses[std::size_t(i)])
        << what << ": step " << i;
  EXPECT_LT(multi.losses.back(), multi.losses.front()) << what << ": did not train";
  if (cfg.overlap_optimizer.value_or(false)) {
    EXPECT_EQ(multi.early_kept, std::uint64_t(steps - 1) * (dims.size() - 1))
        << what;  // every layer after step 1
  }
  for (std::size_t l = 0; l < one.master.size(); ++l)
    for (std::size_t i = 0; i < one.master[l].size(); ++i)
      if (std::fabs(multi.master[l][i] - one.master[l][i]) >
          2e-5 + 2e-5 * std::fabs(one.master[l][i])) {
        ADD_FAILURE() << what << ": layer " << l << " element " << i << ": " << multi.master[l][i]
                      << " vs " << one.master[l][i] << " on one rank";
        break;
      }
  return multi;
}

// A folder of this job's own under the temp folder: the ranks of one mpirun share a parent
// process (the launcher's), and another job running at once (ctest runs the 1-, 2- and 4-rank
// jobs, and the AVX2-capped one, side by side) has another.
std::string job_dir(const char* name) {
  return (fs::temp_directory_path() / fmt::format("{}-{}", name, ::getppid())).string();
}

Placement on(Tier t) {
  Placement p;
  p.device_fraction = t == Tier::kDevice ? 1 : 0;
  p.host_fraction = t == Tier::kHost ? 1 : 0;
  return p;
}

TEST(EngineRanks, Stage3MatchesOneRank) {
  EngineConfig c = default_engine_config();
  compare_with_one_rank(c, "stage 3");
  // No unit resident for its size (the default threshold keeps every unit of this small model):
  // each rank holds a shard of each unit's weights and all-gathers it at every use.
  c.param_persistence_threshold = 0;
  const auto gathered = compare_with_one_rank(c, "stage 3, every unit gathered at each use");
  // (One rank keeps device-placed weights whole: nothing to gather.)
  if (g_env->comm->world_size() > 1) {
    EXPECT_GE(gathered.fetches, std::uint64_t(kSteps) * 3) << "the units were not gathered";
  }
}

TEST(EngineRanks, Stage1MatchesOneRank) {
  EngineConfig c = default_engine_config();
  c.stage = 1;
  compare_with_one_rank(c, "stage 1");
}

TEST(EngineRanks, Stage2MatchesOneRank) {
  EngineConfig c = default_engine_config();
  c.stage = 2;
  compare_with_one_rank(c, "stage 2");
  // Every unit resident, its state on the host, the early optimizer step on: step() leaves
  // kept work to finish behind, and each rank all-gathers a unit's new shard at its next
  // fetch, in the same order everywhere however far its own worker got.
  c.optimizer = on(Tier::kHost);
  c.grads = on(Tier::kHost);
  c.overlap_optimizer = true;
  compare_with_one_rank(c, "stage 2, optimizer on the host, early optimizer step");
}

// ZeRO-3 over the data-parallel group of a tensor x data layout (make_process_groups, TP 2): the
// engine shards over the DP group's ranks only, on a sub-communicator, beside the other DP
// group's engine. Both TP ranks of a pair train the same rows (no layer is split yet), so they
// end with the same weights, bitwise, and each DP group equals one rank on its rows.
TEST(EngineRanks, Stage3OverTheDataParallelGroupOfAProcessGrid) {
  Env& env = *g_env;
  const int n = env.comm->world_size();
  if (n % 2 != 0) GTEST_SKIP() << "a TP group of 2 needs an even number of ranks";
  ProcessGroups pg = make_process_groups(*env.comm, 2);
  ASSERT_EQ(pg.dp->world_size(), n / 2);
  EngineConfig c = default_engine_config();
  c.param_persistence_threshold = 0;  // every unit gathered over the DP group at each use
  c.host_budget_bytes = 64 << 20;
  const std::vector<int> dims = {24, 40, 33, 16};
  const auto dp = train(*env.dev, *pg.dp, c, LinearModel(dims, kRows, 7), kRows, kSteps, kAccum);
  auto dev1 = make_host_device();
  CommOptions co;
  co.backend = CommBackend::kLocal;
  co.process_local = true;
  auto local = make_communicator(*dev1, co);
  const auto one = train(*dev1, *local, c, LinearModel(dims, kRows * (n / 2), 7), kRows * (n / 2),
                         kSteps, kAccum);
  for (int i = 0; i < kSteps; ++i)
    EXPECT_NEAR(dp.losses[std::size_t(i)], one.losses[std::size_t(i)],
                1e-5 * one.losses[std::size_t(i)])
        << "step " << i;
  // The TP pair's weights, bitwise: rank 0's of each pair against rank 1's.
  for (std::size_t l = 0; l < dp.master.size(); ++l) {
    std::vector<float> mine = dp.master[l], other(mine.size());
    Buffer a = env.dev->alloc(4 * mine.size()), b = env.dev->alloc(4 * 2 * mine.size());
    auto st = env.dev->create_stream("tp-check");
    st->copy(a.ref(), host_ref(mine.data(), 4 * mine.size()));
    pg.tp->all_gather(TensorRef{a.ref(), DType::kF32, mine.size()},
                      TensorRef{b.ref(), DType::kF32, 2 * mine.size()}, *st);
    std::vector<float> both(2 * mine.size());
    st->copy(host_ref(both.data(), 4 * both.size()), b.ref());
    st->synchronize();
    EXPECT_EQ(0, std::memcmp(both.data(), both.data() + mine.size(), 4 * mine.size()))
        << "layer " << l << ": the TP pair's weights differ";
  }
}

// An fp16 overflow on one rank only (an Inf in the last rank's input at step 2): every rank
// skips that step (the flag is agreed before any update), no weight changes anywhere, the scale
// halves on every rank, and the ranks train on in step.
TEST(EngineRanks, Fp16OverflowOnOneRankSkipsTheStepEverywhere) {
  Env& env = *g_env;
  EngineConfig c = default_engine_config();
  c.host_budget_bytes = 64 << 20;
  c.compute_dtype = DType::kF16;
  c.fp16.enabled = true;
  c.fp16.initial_scale_power = 8;
  c.fp16.hysteresis = 1;
  c.optimizer = on(Tier::kHost);
  c.grads = on(Tier::kHost);
  c.param_persistence_threshold = 0;
  const LinearModel m({24, 40, 33, 16}, kRows, 7);
  Engine e(*env.dev, *env.comm, c);
  m.register_units(e);
  e.finalize();
  auto s = env.dev->create_stream("compute");
  const int r = env.comm->rank(), n = env.comm->world_size();
  std::vector<double> scales;
  for (int step = 0; step < 5; ++step) {
    auto x = LinearModel::data(24, kRows, r * kRows, step, 1);
    auto t = LinearModel::data(16, kRows, r * kRows, step, 2);
    if (step == 2 && r == n - 1) x[0] = INFINITY;
    std::vector<std::vector<float>> before;
    if (step == 2)
      for (int l = 0; l < m.layers(); ++l) before.push_back(e.gather_master(l));
    m.micro_batch(e, *env.dev, *s, x, t);
    const StepResult res = e.step(1e-2f);
    scales.push_back(res.loss_scale);
    EXPECT_EQ(res.skipped, step == 2) << "rank " << r << " step " << step;
    EXPECT_EQ(res.step, step < 2 ? step + 1 : step) << "rank " << r;
    if (step == 2) {
      for (int l = 0; l < m.layers(); ++l)
        EXPECT_TRUE(e.gather_master(l) == before[std::size_t(l)])
            << "rank " << r << ": layer " << l << " changed";
    }
  }
  EXPECT_EQ(scales[3], scales[2] / 2)
      << "rank " << r << ": the scale did not halve after the overflow";
  // Every rank's scales are rank 0's.
  std::vector<double> mine = scales, first = scales;
  Buffer b = env.dev->alloc(first.size() * 8, s.get());
  s->copy(b.ref(), host_ref(first.data(), first.size() * 8));
  env.comm->broadcast(TensorRef{b.ref(), DType::kF64, first.size()}, 0, *s);
  s->copy(host_ref(first.data(), first.size() * 8), b.ref());
  s->synchronize();
  EXPECT_EQ(mine, first) << "rank " << r;
}

TEST(EngineRanks, OffloadToHostAndNvmeMatchesOneRank) {
  EngineConfig c = default_engine_config();
  const std::string dir = job_dir("strata-engine-mpi-test");
  if (g_env->comm->rank() == 0) fs::create_directories(dir);
  g_env->comm->barrier(*g_env->dev->create_stream("barrier")).synchronize();
  c.params = on(Tier::kNvme);
  c.optimizer = on(Tier::kHost);
  c.optimizer.host_fraction = 0.5;
  c.optimizer.device_fraction = 0;
  c.grads = on(Tier::kHost);
  c.param_nvme_paths = {dir};
  c.optimizer_nvme_paths = {dir};
  c.param_persistence_threshold =
      0;  // every unit's weights read from NVMe and gathered at each use
  EXPECT_GE(compare_with_one_rank(c, "params on NVMe, optimizer half host half NVMe").fetches,
            std::uint64_t(kSteps) * 3);
  // The early optimizer step on every rank (the emulated device's default is off): each rank
  // keeps or redoes by the same global norm and lr, so the ranks stay in step.
  c.overlap_optimizer = true;
  compare_with_one_rank(c, "the same with the early optimizer step");
  g_env->comm->barrier(*g_env->dev->create_stream("barrier")).synchronize();
  std::error_code ec;
  if (g_env->comm->rank() == 0) fs::remove_all(dir, ec);
}

// zero_optimization.reduce_bucket_size below a unit: each unit's gradient reaches its accumulator
// a bucket at a time, gradients on the device or accumulated on the host; a unit of many buckets
// is reduce-scattered bucket by bucket too (every rank's share gathered side by side first:
// here the second unit with 2 ranks), one of a few in one reduce-scatter (the second unit with
// 4 ranks). Against one rank as above, and against whole units: on two ranks bit for bit (a sum
// of two is the same in any order); with more, MPI may pick another algorithm for another
// message size, so within the tolerance only.
// Gradients on NVMe (beside the optimizer state there) go the same way, a bucket at a time to
// their keys.
TEST(EngineRanks, GradientBucketsMatchWholeUnitsAndOneRank) {
  const std::vector<int> dims = {24, 100, 200, 16};  // units of 2400, 20000 and 3200 elements
  const int n = g_env->comm->world_size();
  const std::string dir = job_dir("strata-engine-mpi-buckets");
  if (g_env->comm->rank() == 0) fs::create_directories(dir);
  g_env->comm->barrier(*g_env->dev->create_stream("barrier")).synchronize();
  for (Tier g : {Tier::kDevice, Tier::kHost, Tier::kNvme}) {
    EngineConfig c = default_engine_config();
    c.grads = on(g);
    c.optimizer = on(g);
    if (g == Tier::kNvme) c.optimizer_nvme_paths = c.grad_nvme_paths = {dir};
    c.reduce_bucket_size = 4096;  // a share of 4096 elements (1 rank) or 2048 (2 and 4 ranks)
    const std::string what = fmt::format("buckets of 4096 elements, gradients on {}", tier_name(g));
    const strata::Run split = compare_with_one_rank(c, what.c_str(), dims);
    // Shards of 4096 | 20480 | 4096 elements (1 rank), 2048 | 10240 | 2048 (2: the second
    // reduce-scattered in 5 buckets), 2048 | 5120 | 2048 (4: 3 buckets' shares of one).
    EXPECT_EQ(split.grad_buckets, std::uint64_t(kSteps * kAccum) * (n == 4 ? 5 : 7)) << what;
    EXPECT_EQ(split.reduce_scatters, std::uint64_t(kSteps * kAccum) * (n == 1   ? 0
                                                                       : n == 2 ? 7
                                                                                : 3))
        << what;
    if (n != 2) continue;
    c.reduce_bucket_size = 500'000'000;
    const strata::Run whole = train_ranks(c, dims);
    for (int i = 0; i < kSteps; ++i)
      EXPECT_EQ(split.losses[std::size_t(i)], whole.losses[std::size_t(i)])
          << what << ": step " << i;
    for (std::size_t l = 0; l < whole.master.size(); ++l)
      EXPECT_TRUE(split.master[l] == whole.master[l])
          << what << ": layer " << l << " differs from whole units";
  }
  g_env->comm->barrier(*g_env->dev->create_stream("barrier")).synchronize();
  std::error_code ec;
  if (g_env->comm->rank() == 0) fs::remove_all(dir, ec);
}

// One plan for the job: every rank plans with the least room any rank has (here a smaller
// device on every rank but 0), so a plan that does not fit stops every rank at finalize() —
// rank 0 used to go on alone and wait in its first collective — and one that fits is the same
// plan everywhere.
// A model from scratch through fresh_model_source: each rank computes only the slices it keeps
// (a sub-group at a time, straight to their tier), and the gathered master weights are bitwise
// the same for 1, 2 and 4 ranks (this suite runs under each) and for every placement: what the
// source gives for the whole unit in one call.
TEST(EngineRanks, AFreshModelIsTheSameOnAnyRanksAndPlacement) {
  const ModelConfig mc =
      parse_model_config(R"({"model_type": "llama", "vocab_size": 128, "hidden_size": 64,
    "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 32, "tie_word_embeddings": false})",
                         "tiny llama");
  const std::vector<UnitSpec> units = model_units(mc);
  const ModelSource src = fresh_model_source(mc, 1234);
  const std::string dir = job_dir("strata-engine-mpi-fresh");
  if (g_env->comm->rank() == 0) fs::create_directories(dir);
  g_env->comm->barrier(*g_env->dev->create_stream("barrier")).synchronize();
  for (Tier t : {Tier::kDevice, Tier::kHost, Tier::kNvme}) {
    EngineConfig c = default_engine_config();
    c.params = on(t);
    c.optimizer = on(t);
    c.param_persistence_threshold = 0;
    c.sub_group_size = 1000;  // the source asked for many slices
    if (t == Tier::kNvme) c.param_nvme_paths = c.optimizer_nvme_paths = {dir};
    c.host_budget_bytes = 64 << 20;
    Engine e(*g_env->dev, *g_env->comm, c);
    add_model_units(e, units, src);
    e.finalize();
    for (std::size_t u = 0; u < units.size(); ++u) {
      std::vector<float> want(units[u].numel);
      src(u, 0, want.size(), want.data());
      const std::vector<float> got = e.gather_master(int(u));
      ASSERT_EQ(got.size(), want.size()) << units[u].name;
      EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * 4), 0)
          << units[u].name << " on " << tier_name(t) << " differs on " << g_env->comm->world_size()
          << " rank(s)";
    }
  }
  g_env->comm->barrier(*g_env->dev->create_stream("barrier")).synchronize();
  std::error_code ec;
  if (g_env->comm->rank() == 0) fs::remove_all(dir, ec);
}

// Loss normalisation across ranks, the trainer's way (step_loss_denominator): a step of 4 SFT rows
// whose masked prompts leave 14, 7, 11 and 3 counted targets, as N ranks x 4/N micro-batches of one
// row (rank r takes row a N + r) against one rank with one micro-batch of the 4 rows: the same loss
// (the step's sum over its counted targets / their number) and master weights (within 3e-5 of each
// unit's largest, as train_bridge_test's same comparison on one rank).
struct SftRun {
  std::vector<double> losses;
  std::vector<std::vector<float>> master;
};

Batch sft_row(int step, int i, std::int64_t vocab) {
  static constexpr int kPrompt[4] = {2, 9, 5, 13};
  Batch b;
  for (int t = 0; t < 16; ++t) {
    b.tokens.push_back(std::int32_t((step * 31 + i * 17 + t * 7) % vocab));
    b.targets.push_back(t < kPrompt[i] ? kIgnoreTarget
                                       : std::int32_t((step * 11 + i * 5 + t * 13 + 1) % vocab));
  }
  return b;
}

SftRun train_sft(Device& dev, Communicator& comm, const ModelConfig& mc, int rows_per_micro) {
  const int n = comm.world_size(), r = comm.rank();
  const int accum = 4 / (rows_per_micro * n);
  EngineConfig cfg = default_engine_config();
  cfg.gradient_accumulation_steps = accum;
  cfg.host_budget_bytes = 64 << 20;
  cfg.adamw.eps = 1e-3f;  // see the comment above train(); lr / eps = 10 here
  auto s = dev.create_stream("compute");
  Model model(mc, dev, *s, {.micro_batch = rows_per_micro, .seq_len = 16});
  Engine e(dev, comm, cfg);
  add_model_units(e, model.units(), fresh_model_source(mc, 9));
  e.finalize();
  EngineWeights w(e, *s, model.units());
  SftRun out;
  for (int step = 0; step < 3; ++step) {
    // Every rank reads every rank's rows: the step's counted targets without a collective.
    std::vector<Batch> rows;
    std::int64_t counted = 0;
    for (int i = 0; i < 4; ++i) {
      rows.push_back(sft_row(step, i, mc.vocab_size));
      counted += counted_targets(rows.back());
    }
    const double den = step_loss_denominator(counted, accum, n, step + 1);
    double loss = 0;
    for (int a = 0; a < accum; ++a) {
      Batch b;
      for (int k = 0; k < rows_per_micro; ++k) {
        const Batch& row = rows[std::size_t((a * n + r) * rows_per_micro + k)];
        b.tokens.insert(b.tokens.end(), row.tokens.begin(), row.tokens.end());
        b.targets.insert(b.targets.end(), row.targets.begin(), row.targets.end());
      }
      loss += model.forward(b, w, true, den) / accum;
      model.backward(w);
    }
    e.step(1e-2f);
    if (n > 1) {  // as the trainer: the ranks' values averaged
      Buffer buf = dev.alloc(8, s.get());
      s->copy(buf.ref(), host_ref(&loss, 8));
      comm.all_reduce(TensorRef{buf.ref(), DType::kF64, 1}, ReduceOp::kSum, *s);
      s->copy(host_ref(&loss, 8), buf.ref());
      s->synchronize();
      loss /= n;
    }
    out.losses.push_back(loss);
  }
  for (std::size_t u = 0; u < model.units().size(); ++u)
    out.master.push_back(e.gather_master(int(u)));
  return out;
}

TEST(EngineRanks, SftStepLossIsTheMeanOverItsCountedTargetsOnAnyRanks) {
  const ModelConfig mc =
      parse_model_config(R"({"model_type": "llama", "vocab_size": 61, "hidden_size": 32,
    "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 16})",
                         "tiny llama");
  const SftRun multi = train_sft(*g_env->dev, *g_env->comm, mc, 1);
  auto dev1 = make_host_device();
  CommOptions co;
  co.backend = CommBackend::kLocal;
  co.process_local = true;
  auto local = make_communicator(*dev1, co);
  const SftRun one = train_sft(*dev1, *local, mc, 4);
  for (std::size_t i = 0; i < one.losses.size(); ++i)
    EXPECT_NEAR(multi.losses[i], one.losses[i], 1e-5 * one.losses[i]) << "step " << i + 1;
  for (std::size_t u = 0; u < one.master.size(); ++u) {
    double num = 0, den = 0;
    for (std::size_t k = 0; k < one.master[u].size(); ++k) {
      num = std::max(num, std::fabs(double(multi.master[u][k]) - one.master[u][k]));
      den = std::max(den, std::fabs(double(one.master[u][k])));
    }
    EXPECT_LT(num / den, 3e-5) << "master weights of unit " << u << " on "
                               << g_env->comm->world_size() << " rank(s)";
  }
}

TEST(EngineRanks, EveryRankPlansWithTheLeastRoomAnyRankHas) {
  if (g_env->comm->world_size() == 1) GTEST_SKIP() << "one rank: no other rank to agree with";
  const int r = g_env->comm->rank();
  for (const std::size_t small : {std::size_t(1) << 20, std::size_t(128) << 20}) {
    HostDeviceOptions o;
    o.capacity_bytes = r == 0 ? std::size_t(256) << 20 : small;
    auto dev = make_host_device(o);
    auto comm = make_communicator(*dev);
    EngineConfig c = default_engine_config();
    c.host_budget_bytes = 64 << 20;
    Engine e(*dev, *comm, c);
    LinearModel({512, 512, 512}, 2, 3).register_units(e);  // 0.5M parameters: ~10 MB on the device
    if (small < (std::size_t(8) << 20)) {
      try {
        e.finalize();
        ADD_FAILURE() << "rank " << r << ": a plan that does not fit on every rank was accepted";
      } catch (const Error& err) {
        EXPECT_EQ(err.kind(), ErrorKind::kOutOfMemory) << err.what();
        EXPECT_NE(std::string(err.what()).find("device: needs"), std::string::npos) << err.what();
      }
    } else {
      e.finalize();
      EXPECT_EQ(e.plan().device_capacity, small) << "rank " << r;
    }
  }
}

// Ranks given settings that decide their collectives differently stop together in finalize,
// naming the key (a reduce_bucket_size of one rank's own ended in a double free inside MPI; a
// persistence threshold in a truncated all-gather).
TEST(EngineRanks, RanksGivenDifferentSettingsStopNamingTheKey) {
  if (g_env->comm->world_size() == 1) GTEST_SKIP() << "one rank: no other rank to differ from";
  const int r = g_env->comm->rank();
  struct Case {
    const char* key;
    void (*differ)(EngineConfig&);
  };
  const Case cases[] = {
      {"zero_optimization.reduce_bucket_size",
       [](EngineConfig& c) { c.reduce_bucket_size = 4096; }},
      {"zero_optimization.stage3_param_persistence_threshold",
       [](EngineConfig& c) { c.param_persistence_threshold = 1 << 30; }},
      {"the optimizer state's placement", [](EngineConfig& c) { c.optimizer = on(Tier::kHost); }},
      // (a planner input: with a small host budget one rank alone did not fit, and stopped, while
      // the other went on into an all-gather)
      {"zero_optimization.offload_optimizer.buffer_count",
       [](EngineConfig& c) { c.optimizer_buffer_count = 1000; }}};
  for (const Case& k : cases) {
    EngineConfig c = default_engine_config();
    c.host_budget_bytes = 64 << 20;
    if (r == 1) k.differ(c);
    Engine e(*g_env->dev, *g_env->comm, c);
    LinearModel({64, 64, 64}, 2, 3).register_units(e);
    try {
      e.finalize();
      ADD_FAILURE() << "rank " << r << ": " << k.key
                    << " differs between the ranks and finalize went on";
    } catch (const Error& err) {
      EXPECT_NE(std::string(err.what()).find(std::string("different engine settings: ") + k.key),
                std::string::npos)
          << err.what();
    }
  }
  // A setting one rank's host refuses (more optimizer threads than it runs): that rank says why,
  // the others that it did, all at once.
  {
    EngineConfig c = default_engine_config();
    c.host_budget_bytes = 64 << 20;
    c.optimizer = on(Tier::kHost);
    c.grads = on(Tier::kHost);
    if (r == 1) c.optimizer_threads = 4096;
    Engine e(*g_env->dev, *g_env->comm, c);
    LinearModel({64, 64, 64}, 2, 3).register_units(e);
    try {
      e.finalize();
      ADD_FAILURE() << "rank " << r << ": rank 1's refused optimizer_threads and finalize went on";
    } catch (const Error& err) {
      EXPECT_NE(std::string(err.what())
                    .find(r == 1 ? "config key 'strata.optimizer_threads' = 4096"
                                 : "another rank's host refused its settings"),
                std::string::npos)
          << err.what();
    }
  }
  // The same settings still go on.
  EngineConfig c = default_engine_config();
  c.host_budget_bytes = 64 << 20;
  Engine e(*g_env->dev, *g_env->comm, c);
  LinearModel({64, 64, 64}, 2, 3).register_units(e);
  e.finalize();
}

}  // namespace
}  // namespace strata

int main(int argc, char** argv) {
  using namespace strata;
  ::testing::InitGoogleTest(&argc, argv);
  strata::testing::RankEnv env;
  // Random delays: the collectives must be ordered on the streams that use their buffers.
  if (!strata::testing::open_rank_env(env, std::size_t(256) << 20, 30, "engine_mpi_test")) return 1;
  g_env = &env;
  return strata::testing::run_tests_on_rank(env.launch.rank, "engine_mpi_test");
}
