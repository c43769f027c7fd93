// The performance model held to the engine: for each placement class, one step of a tiny Llama
// is traced on the CPU-emulated device and replayed by predict_step(), and each stream's
// sequence of link transfers (host-to-device and device-to-host copies, with their bytes) and
// the step's NVMe bytes read and written must be the same in both. The model's timing is not
// checked here (that is strata-prof --validate's job): what is checked is that the model replays
// the operations the engine queues, on the streams it queues them on, in the order it queues
// them, so a change to what the engine overlaps fails here until the model follows.
//
// The early optimizer step (strata.overlap_optimizer) is off in most classes: with it on, the
// worker's progress when a step ends decides which kept units' new weights go up at once and which
// at their next fetch, and how much of its NVMe traffic falls inside the traced step. Its classes
// compare the streams that do not depend on that (the gradients' way off the device on the comm
// stream, the step's work on the optimizer stream), in order.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "strata/comm.h"
#include "strata/engine.h"
#include "strata/model.h"
#include "strata/perf_model.h"
#include "strata/trace.h"
#include "strata/trainer.h"
#include "test_util.h"

namespace strata {
namespace {

using testing::TempDir;

constexpr int kB = 2, kT = 16;

// Units of distinct sizes, so a sequence of bytes names its units: an untied head, layers of
// one size (told apart by their order), an embedding of another.
ModelConfig tiny_llama() {
  return parse_model_config(R"({"model_type": "llama", "vocab_size": 160, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": false})",
                            "tiny llama");
}

Batch batch_of(int i, std::int64_t vocab) {
  std::mt19937_64 rng(77 + std::uint64_t(i));
  Batch b;
  for (int k = 0; k < kB * kT; ++k) {
    b.tokens.push_back(std::int32_t(rng() % std::uint64_t(vocab)));
    b.targets.push_back(std::int32_t(rng() % std::uint64_t(vocab)));
  }
  return b;
}

// What one lane did: its operations in order, each "<kind> <bytes>".
using Lanes = std::map<std::string, std::vector<std::string>>;

struct Observed {
  Lanes streams;  // the engine's streams' link copies
  std::uint64_t nvme_read = 0, nvme_written = 0;
};

// The engine's streams whose copies the model replays (the compute stream's are the model's
// own: its inputs and its loss).
bool engine_stream(const std::string& s) {
  return s == "fetch" || s == "comm" || s == "optimizer" || s == "writeback";
}

// Step 2 of a run under `cfg` (step 1 records the order the engine prefetches in), traced until
// every stream is idle.
Observed run_engine(const ModelConfig& mc, const EngineConfig& cfg, bool ranks,
                    std::vector<UnitSize>* sizes) {
  auto dev = make_host_device();
  CommOptions co;
  if (!ranks) co.backend = CommBackend::kLocal;  // (else the launcher's MPI)
  auto comm = make_communicator(*dev, co);
  auto s = dev->create_stream("compute");
  Model model(mc, *dev, *s, {.micro_batch = kB, .seq_len = kT, .compute = cfg.compute_dtype});
  Engine e(*dev, *comm, cfg);
  add_model_units(e, model.units(), initial_unit_weights(mc, "", 5));
  e.finalize();
  for (const UnitSpec& u : model.units()) sizes->push_back({u.name, u.numel});
  EngineWeights w(e, *s, model.units());
  Tracer& tr = Tracer::global();
  int mb = 0;
  for (int step = 1; step <= 2; ++step) {
    if (step == 2) {
      tr.clear();
      tr.set_enabled(true);
    }
    e.set_next_lr(1e-3f);
    for (int a = 0; a < cfg.gradient_accumulation_steps; ++a) {
      model.forward(batch_of(mb++, mc.vocab_size), w);
      model.backward(w);
      s->synchronize();
    }
    e.step(1e-3f);
    dev->synchronize();
  }
  tr.set_enabled(false);
  Observed o;
  for (const TraceSpan& sp : tr.spans()) {
    if ((sp.name == "copy_h2d" || sp.name == "copy_d2h") && engine_stream(sp.lane))
      o.streams[sp.lane].push_back(fmt::format("{} {}", sp.name, sp.bytes));
    if ((sp.name == "all_gather" || sp.name == "reduce_scatter" || sp.name == "all_reduce") &&
        engine_stream(sp.lane))
      o.streams[sp.lane].push_back(sp.name);
    if (sp.lane.starts_with("nvme"))
      (sp.name == "nvme_read" ? o.nvme_read : o.nvme_written) += sp.bytes;
  }
  tr.clear();
  return o;
}

// The same step as the model replays it.
Observed replay(const std::vector<UnitSize>& sizes, const EngineConfig& cfg, int world) {
  MachineProfile m;
  m.world_size = world;
  m.all_gather_bps = m.reduce_scatter_bps = 5e9;
  m.h2d_bps = m.d2h_bps = 10e9;
  m.device_mem_bps = 50e9;
  m.host_mem_bps = 20e9;
  m.nvme_read_bps = m.nvme_write_bps = 2e9;
  m.cpu_adamw_params_per_s = 1e9;
  m.device_adamw_params_per_s = 1e10;
  ModelProfile mp;
  mp.micro_batch = kB;
  mp.seq_len = kT;
  for (const UnitSize& u : sizes) mp.units.push_back({u.name, u.numel, 1e-3, 2e-3});
  const Prediction p = predict_step(m, mp, cfg);
  Observed o;
  for (const Interval& iv : p.schedule) {
    if ((iv.lane == Resource::kH2D || iv.lane == Resource::kD2H) && engine_stream(iv.stream))
      o.streams[iv.stream].push_back(
          fmt::format("{} {}", iv.lane == Resource::kH2D ? "copy_h2d" : "copy_d2h", iv.bytes));
    if (iv.lane == Resource::kNvme)
      (iv.what.starts_with("read") ? o.nvme_read : o.nvme_written) += iv.bytes;
    if (iv.lane == Resource::kComm &&
        engine_stream(iv.stream))  // "all-gather layers.0" -> all_gather
      o.streams[iv.stream].push_back(iv.what.starts_with("all-gather")       ? "all_gather"
                                     : iv.what.starts_with("reduce-scatter") ? "reduce_scatter"
                                                                             : "all_reduce");
  }
  return o;
}

std::string show(const std::vector<std::string>& ops) {
  std::string s;
  for (const std::string& x : ops) s += "\n    " + x;
  return s.empty() ? "\n    (nothing)" : s;
}

struct Class {
  std::string name;
  std::string zero;  // the zero_optimization block's placement keys
  bool early = false;
  int accum = 2;
  bool device_norm = false;  // strata.device_grad_norm
};

// A ds_config.json of the class, as a user would write it.
std::string config_json(const Class& c, const std::string& dir) {
  std::string z = c.zero;
  for (std::size_t at; (at = z.find("$NVME")) != std::string::npos;) z.replace(at, 5, dir);
  return fmt::format(
      R"({{"train_micro_batch_size_per_gpu": {}, "gradient_accumulation_steps": {}, "bf16": {{"enabled": true}},
          "zero_optimization": {{"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 4000,
                                 "reduce_bucket_size": 6000 {}}},
          "strata": {{"overlap_optimizer": {}, "device_grad_norm": {}, "host_budget_bytes": 67108864}}}})",
      kB, c.accum, z, c.early, c.device_norm);
}

void PrintTo(const Class& c, std::ostream* os) { *os << c.name; }

// One class: the engine's step on this process's ranks (`ranks`: every rank of the launcher's
// MPI job, each comparing its own streams; else one rank alone) against the model's replay.
void check_class(const Class& c, bool ranks) {
  const int world = ranks ? launch_info().world_size : 1;
  TempDir dir("conformance");
  const EngineConfig cfg = parse_engine_config(config_json(c, dir.path), world);
  std::vector<UnitSize> sizes;
  Observed engine = run_engine(tiny_llama(), cfg, ranks, &sizes);
  const Observed model = replay(sizes, cfg, world);
  if (world > 1) {  // (not compared vacuously: the collectives are there)
    auto count = [&](const std::string& st, const std::string& op) {
      return engine.streams.count(st)
                 ? std::count(engine.streams.at(st).begin(), engine.streams.at(st).end(), op)
                 : 0;
    };
    EXPECT_GT(count("fetch", "all_gather"), 0);
    EXPECT_GT(count("comm", "reduce_scatter"), 0);
  }
  std::set<std::string> streams;
  for (const auto& [k, v] : engine.streams) streams.insert(k);
  for (const auto& [k, v] : model.streams) streams.insert(k);
  for (const std::string& st : streams) {
    if (c.early && st != "comm" && st != "optimizer") continue;
    const std::vector<std::string> none,
        &a = engine.streams.count(st) ? engine.streams.at(st) : none,
        &b = model.streams.count(st) ? model.streams.at(st) : none;
    EXPECT_EQ(a, b) << "stream \"" << st << "\"\n  engine:" << show(a) << "\n  model:" << show(b);
  }
  if (c.early) {
    EXPECT_FALSE(engine.streams["comm"].empty())
        << "the gradients leave the device on the comm stream";
    return;
  }
  EXPECT_EQ(engine.nvme_read, model.nvme_read) << "NVMe bytes read in the step";
  EXPECT_EQ(engine.nvme_written, model.nvme_written) << "NVMe bytes written in the step";
}

class Conformance : public ::testing::TestWithParam<Class> {};

TEST_P(Conformance, TheModelReplaysWhatTheEngineQueues) { check_class(GetParam(), false); }

// The same across ranks (the ctest entry conformance_ranks_2 runs it under mpirun -np 2): the
// all-gathers on the fetch stream, the reduce-scatters on the comm stream, the norm's
// all-reduce. Skipped in a plain process.
class ConformanceRanks : public ::testing::TestWithParam<Class> {};

TEST_P(ConformanceRanks, TheModelReplaysWhatTheEngineQueues) {
  if (launch_info().world_size < 2)
    GTEST_SKIP() << "runs under mpirun -np 2 (ctest: conformance_ranks_2)";
  init_launch();
  check_class(GetParam(), true);
}

const std::vector<Class> kClasses = {
    {"AllOnDevice", ""},
    {"ParamsHost", R"(, "offload_param": {"device": "cpu"})"},
    {"ParamsNvme", R"(, "offload_param": {"device": "nvme", "nvme_path": "$NVME"})"},
    {"OptimizerHost", R"(, "offload_optimizer": {"device": "cpu"})"},
    {"OptimizerHostOneMicroBatch", R"(, "offload_optimizer": {"device": "cpu"})", false, 1},
    {"OptimizerHostNormOnTheDevice", R"(, "offload_optimizer": {"device": "cpu"})", false, 1, true},
    {"OptimizerNvme", R"(, "offload_optimizer": {"device": "nvme", "nvme_path": "$NVME"})"},
    {"Infinity", R"(, "offload_param": {"device": "nvme", "nvme_path": "$NVME"},
                    "offload_optimizer": {"device": "nvme", "nvme_path": "$NVME"})"},
    {"GradsNvme",
     R"(, "offload_optimizer": {"device": "nvme", "nvme_path": "$NVME"}, "offload_grads": "nvme")"},
    {"GradsHostOptimizerDevice", R"(, "offload_grads": "cpu")"},
    {"ParamsHostOptimizerDevice",
     R"(, "offload_param": {"device": "cpu"}, "offload_grads": "none")"},
    {"EarlyOptimizerHost", R"(, "offload_optimizer": {"device": "cpu"})", true},
    {"EarlyOptimizerNvme", R"(, "offload_optimizer": {"device": "nvme", "nvme_path": "$NVME"})",
     true},
};

INSTANTIATE_TEST_SUITE_P(Placements, Conformance, ::testing::ValuesIn(kClasses),
                         [](const ::testing::TestParamInfo<Class>& i) { return i.param.name; });
INSTANTIATE_TEST_SUITE_P(Placements, ConformanceRanks, ::testing::ValuesIn(kClasses),
                         [](const ::testing::TestParamInfo<Class>& i) { return i.param.name; });

}  // namespace
}  // namespace strata
