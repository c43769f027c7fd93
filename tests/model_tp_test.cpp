// Megatron tensor parallelism in the model, under mpirun (MPI on the CPU-emulated device): the
// ranks of a TP group each run the same batch with their slice of every split layer, and every rank
// also runs the whole model (TP 1) alone as the reference. The TP ranks' loss must equal the
// reference's, and each rank's gradients the reference's gradients' slice of that rank, to fp32
// rounding (the row-parallel sums and the vocabulary-parallel log-sum-exp run in another order);
// the replicated parameters' gradients and the loss must be bitwise equal on every TP rank (the
// replicas stay equal without a reduction). With 4 ranks: TP 4, and TP 2 x DP 2 (two TP groups
// side by side, from make_process_groups); with 8, TP 4 x DP 2. Then the ZeRO-3 engine over each DP
// group, the model's TP slices its units: steps of it against the whole model trained by one rank
// alone.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <random>

#include "strata/comm.h"
#include "strata/engine.h"
#include "strata/error.h"
#include "strata/model.h"
#include "strata/trainer.h"
#include "test_util.h"

namespace strata {
namespace {

using Env = testing::RankEnv;
Env* g_env = nullptr;

// GQA (8 query heads, 4 key/value heads) with attention biases (q/k/v split, o replicated); the
// vocabulary 67 splits unevenly (34 + 33, 17 x 3 + 16).
const char* kLlama =
    R"({"model_type": "llama", "vocab_size": 67, "hidden_size": 32, "intermediate_size": 48,
  "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
  "max_position_embeddings": 32, "attention_bias": true})";
// Tied embeddings (the vocabulary-parallel head is the embedding's rows), fused c_attn, learned
// positions (replicated).
const char* kGpt2 =
    R"({"model_type": "gpt2", "vocab_size": 61, "n_embd": 32, "n_layer": 2, "n_head": 4,
  "n_positions": 16})";

// Qwen2: q/k/v biases (split with their heads) and no o bias, tied embeddings (the vocabulary-
// parallel head is the embedding's rows, as GPT-2's).
const char* kQwen2 =
    R"({"model_type": "qwen2", "vocab_size": 67, "hidden_size": 32, "intermediate_size": 48,
  "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
  "max_position_embeddings": 32, "tie_word_embeddings": true})";
// Mistral: no attention biases at all (the Llama above has them), untied; its sliding window
// longer than the sequence (a shorter one is refused: strata's attention is full causal).
const char* kMistral =
    R"({"model_type": "mistral", "vocab_size": 67, "hidden_size": 32, "intermediate_size": 48,
  "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
  "max_position_embeddings": 32, "sliding_window": 4096})";

constexpr std::int64_t kB = 2, kT = 8;

Batch make_batch(std::int64_t vocab, bool packed, bool ignore_some) {
  std::mt19937_64 rng(11);  // the same batch on every rank
  Batch b;
  for (std::int64_t i = 0; i < kB * kT; ++i) {
    b.tokens.push_back(static_cast<std::int32_t>(rng() % vocab));
    b.targets.push_back(static_cast<std::int32_t>(rng() % vocab));
    if (ignore_some && i % 5 == 2) b.targets.back() = kIgnoreTarget;
  }
  if (packed)  // row 0: documents of 3 and 5 tokens; row 1 whole
    for (std::int64_t i = 0; i < kB * kT; ++i)
      b.positions.push_back(static_cast<std::int32_t>(i < 3 ? i : i < kT ? i - 3 : i - kT));
  return b;
}

struct Case {
  const char* cfg;
  DType dtype = DType::kF32;
  bool checkpoint = false;
  bool packed = false;
  bool sequence_parallel = false;
};

struct Result {
  float loss = 0;
  std::vector<std::vector<float>> grads;  // per parameter of the model's units, in order
  std::vector<float> logits;              // [B*T, vocab]
};

Result run(const ModelConfig& cfg, const Case& c, Communicator* tp) {
  Device& dev = *g_env->dev;
  auto s = dev.create_stream("model");
  ModelOptions mo;
  mo.micro_batch = kB;
  mo.seq_len = kT;
  mo.compute = c.dtype;
  mo.checkpoint = c.checkpoint;
  mo.loss_chunk_rows = 5;  // several chunks, the last one short
  mo.tensor_parallel = tp;
  mo.sequence_parallel = tp && c.sequence_parallel;
  Model m(cfg, dev, *s, mo);
  ResidentWeights w(m, *s);
  w.init_random(7);  // each TP rank's slices of the same full tensors
  w.zero_grads();
  const Batch batch = make_batch(cfg.vocab_size, c.packed, true);
  Result r;
  r.loss = m.forward(batch, w);
  m.backward(w);
  for (const UnitSpec& u : w.units())
    for (const ParamSpec& p : u.params) r.grads.push_back(w.grad(p.name));
  r.logits = m.logits(batch.tokens, w);
  return r;
}

float max_abs(const std::vector<float>& v) {
  float m = 0;
  for (float x : v) m = std::max(m, std::fabs(x));
  return m;
}

// Every rank of `comm`'s copy of `v` (host memory), rank after rank.
std::vector<float> gathered(Communicator& comm, const std::vector<float>& v) {
  std::vector<float> mine = v, all(v.size() * std::size_t(comm.world_size()));
  auto s = comm.device().create_stream("gather");
  comm.all_gather(TensorRef{host_ref(mine.data(), mine.size() * 4), DType::kF32, mine.size()},
                  TensorRef{host_ref(all.data(), all.size() * 4), DType::kF32, all.size()}, *s);
  s->synchronize();
  return all;
}

// Whether every rank of `comm` holds `v` bit for bit.
bool equal_on_every_rank(Communicator& comm, const std::vector<float>& v) {
  const std::vector<float> all = gathered(comm, v);
  for (int r = 1; r < comm.world_size(); ++r)
    if (std::memcmp(all.data() + std::size_t(r) * v.size(), all.data(), v.size() * 4) != 0)
      return false;
  return true;
}

void check_case(const Case& c, Communicator& tp) {
  const ModelConfig cfg = parse_model_config(c.cfg, "test config");
  const Result ref = run(cfg, c, nullptr);
  const Result got = run(cfg, c, &tp);
  const std::vector<UnitSpec> full = model_units(cfg);
  const std::vector<UnitSpec> mine = model_units(cfg, {tp.world_size(), tp.rank()});
  // fp32: the sums run in another order. bf16: an activation a last fp32 bit away may round to the
  // neighbouring bf16 value (2^-8 relative) before the next GEMM.
  const double tol = c.dtype == DType::kF32 ? 2e-5 : 1e-2;
  EXPECT_NEAR(got.loss, ref.loss, tol * std::fabs(ref.loss));
  EXPECT_TRUE(equal_on_every_rank(tp, {got.loss})) << "the TP ranks' losses differ";
  std::size_t i = 0, split = 0, replicated = 0;
  for (std::size_t u = 0; u < mine.size(); ++u)
    for (std::size_t k = 0; k < mine[u].params.size(); ++k, ++i) {
      const ParamSpec& p = mine[u].params[k];
      ASSERT_EQ(p.name, full[u].params[k].name);
      const std::vector<float> want = tp_slice(p, ref.grads[i]);
      ASSERT_EQ(got.grads[i].size(), want.size()) << p.name;
      const float scale = std::max(max_abs(ref.grads[i]), 1e-6f);
      float worst = 0;
      for (std::size_t e = 0; e < want.size(); ++e)
        worst = std::max(worst, std::fabs(got.grads[i][e] - want[e]));
      EXPECT_LE(worst, tol * scale) << p.name << " (TP rank " << tp.rank() << ")";
      if (p.split()) {
        ++split;
      } else {
        ++replicated;
        EXPECT_TRUE(equal_on_every_rank(tp, got.grads[i]))
            << p.name << ": a replicated parameter's gradient differs across the TP ranks";
      }
    }
  EXPECT_GT(split, 0u);
  EXPECT_GT(replicated, 0u);
  ASSERT_EQ(got.logits.size(), ref.logits.size());
  const float lscale = max_abs(ref.logits);
  float worst = 0;
  for (std::size_t e = 0; e < ref.logits.size(); ++e)
    worst = std::max(worst, std::fabs(got.logits[e] - ref.logits[e]));
  EXPECT_LE(worst, tol * lscale) << "logits";
}

// The TP groups a test runs: the whole world (up to 4 ranks), with 4 ranks also TP 2 x DP 2, and
// with 8 TP 4 x DP 2.
std::vector<ProcessGroups> groups() {
  const int w = g_env->comm->world_size();
  std::vector<ProcessGroups> out;
  out.push_back(make_process_groups(*g_env->comm, w == 8 ? 4 : w));
  if (w == 4) out.push_back(make_process_groups(*g_env->comm, 2));
  return out;
}

class ModelTp : public ::testing::TestWithParam<Case> {};

TEST_P(ModelTp, EqualsOneRankWithTheWholeModel) {
  if (g_env->comm->world_size() < 2) GTEST_SKIP() << "needs mpirun -np 2, 4 or 8";
  for (ProcessGroups& g : groups()) {
    SCOPED_TRACE("TP " + std::to_string(g.tp_size) + " x DP " + std::to_string(g.dp_size));
    check_case(GetParam(), *g.tp);
  }
}

INSTANTIATE_TEST_SUITE_P(Families, ModelTp,
                         ::testing::Values(Case{kLlama}, Case{kGpt2}, Case{kLlama, DType::kBF16},
                                           Case{kGpt2, DType::kBF16},
                                           Case{kLlama, DType::kF32, true, true},
                                           Case{kGpt2, DType::kF32, true, true},
                                           // Megatron's sequence parallelism, the same cases
                                           Case{kLlama, DType::kF32, false, false, true},
                                           Case{kGpt2, DType::kF32, false, false, true},
                                           Case{kLlama, DType::kBF16, false, false, true},
                                           Case{kGpt2, DType::kBF16, false, false, true},
                                           Case{kLlama, DType::kF32, true, true, true},
                                           Case{kGpt2, DType::kF32, true, true, true},
                                           // the other families
                                           Case{kQwen2}, Case{kMistral},
                                           Case{kQwen2, DType::kF32, false, false, true},
                                           Case{kMistral, DType::kF32, true, true, true}),
                         [](const ::testing::TestParamInfo<Case>& i) {
                           std::string n = i.param.cfg == kLlama   ? "LlamaGqa"
                                           : i.param.cfg == kGpt2  ? "Gpt2"
                                           : i.param.cfg == kQwen2 ? "Qwen2Tied"
                                                                   : "MistralNoBias";
                           n += i.param.dtype == DType::kBF16 ? "Bf16" : "Fp32";
                           if (i.param.checkpoint) n += "CheckpointedPacked";
                           if (i.param.sequence_parallel) n += "SequenceParallel";
                           return n;
                         });

// The TP collectives one forward and backward of the Llama test model queue.
Model::TpTraffic step_traffic(Communicator& tp, bool checkpoint, bool sequence_parallel) {
  const ModelConfig cfg = parse_model_config(kLlama, "test config");
  Device& dev = *g_env->dev;
  auto s = dev.create_stream("traffic");
  ModelOptions mo;
  mo.micro_batch = kB;
  mo.seq_len = kT;
  mo.checkpoint = checkpoint;
  mo.loss_chunk_rows = 5;
  mo.tensor_parallel = &tp;
  mo.sequence_parallel = sequence_parallel;
  Model m(cfg, dev, *s, mo);
  ResidentWeights w(m, *s);
  w.init_random(1);
  m.forward(make_batch(cfg.vocab_size, false, false), w);
  m.backward(w);
  s->synchronize();
  return m.tp_traffic();
}

// Sequence parallelism against plain TP at the same layout: the same loss and gradients to fp32
// rounding (a reduce-scatter and a sum of row parts in another order), and its traffic: per layer
// each way the 2 reduce-scatters of B x T x hidden that replace the all-reduces, 2 all-gathers of
// the norms' outputs in the forward and 4 in the backward (g twice, the norms' outputs again).
TEST(ModelTpSequenceParallel, EqualsPlainTensorParallelismWithItsTraffic) {
  if (g_env->comm->world_size() < 2) GTEST_SKIP() << "needs mpirun -np 2, 4 or 8";
  ProcessGroups g = std::move(groups().front());
  const ModelConfig cfg = parse_model_config(kLlama, "test config");
  const Result plain = run(cfg, Case{kLlama}, g.tp.get());
  const Result seq = run(cfg, Case{kLlama, DType::kF32, false, false, true}, g.tp.get());
  EXPECT_NEAR(seq.loss, plain.loss, 2e-6 * plain.loss);
  for (std::size_t i = 0; i < plain.grads.size(); ++i) {
    const float scale = std::max(max_abs(plain.grads[i]), 1e-6f);
    for (std::size_t e = 0; e < plain.grads[i].size(); ++e)
      ASSERT_LE(std::fabs(seq.grads[i][e] - plain.grads[i][e]), 2e-5 * scale) << "tensor " << i;
  }
  const Model::TpTraffic t = step_traffic(*g.tp, false, true);
  const std::uint64_t L = std::uint64_t(cfg.num_layers), act = kB * kT * cfg.hidden_size * 4;
  // Each way 2 a layer, the embedding's and the head's input gradient's.
  EXPECT_EQ(t.reduce_scatters, 4 * L + 2);
  EXPECT_EQ(t.reduce_scatter_bytes, (4 * L + 2) * act);
  // Forward 2 a layer and the head's input; backward 4 a layer and the embedding's gradient;
  // the cross-entropy's one a chunk (5 rows: 4 chunks) beside.
  const std::uint64_t n = std::uint64_t(g.tp_size), chunks = (kB * kT + 4) / 5;
  EXPECT_EQ(t.all_gathers, 6 * L + 2 + chunks);
  EXPECT_EQ(t.all_gather_bytes, (6 * L + 2) * act / n + std::uint64_t(kB * kT) * 2 * 4);
  // The replicated parameters' gradients: 2 norms a layer and o_proj's bias, the final norm.
  EXPECT_EQ(t.all_reduces, 3 * L + 1);
}

// Decoding with the key/value cache: the TP ranks' logits of each new token equal the whole
// model's.
TEST(ModelTpDecode, CachedDecodingEqualsTheWholeModel) {
  if (g_env->comm->world_size() < 2) GTEST_SKIP() << "needs mpirun -np 2, 4 or 8";
  ProcessGroups g = std::move(groups().front());
  for (const char* json : {kLlama, kGpt2}) {
    const ModelConfig cfg = parse_model_config(json, "test config");
    std::vector<std::vector<float>> out[2];
    for (int t = 0; t < 2; ++t) {
      Device& dev = *g_env->dev;
      auto s = dev.create_stream("decode");
      ModelOptions mo;
      mo.seq_len = kT;
      mo.tensor_parallel = t == 1 ? g.tp.get() : nullptr;
      Model m(cfg, dev, *s, mo);
      ResidentWeights w(m, *s);
      w.init_random(3);
      out[t].push_back(m.decode({1, 5, 2}, w));
      out[t].push_back(m.decode({7}, w));
    }
    for (std::size_t k = 0; k < 2; ++k) {
      ASSERT_EQ(out[1][k].size(), std::size_t(cfg.vocab_size));
      for (std::size_t e = 0; e < out[0][k].size(); ++e)
        EXPECT_NEAR(out[1][k][e], out[0][k][e], 2e-5 * max_abs(out[0][k])) << cfg.model_type;
    }
  }
}

// The TP collectives a step queues: 2 all-reduces of B x T x hidden a layer each way (Megatron's
// count), one more a layer recomputed under checkpointing, the embedding's and the head's input
// gradient's; one all-gather of the cross-entropy's 2 floats a row per LM-head chunk.
TEST(ModelTpTraffic, TwoAllReducesOfTheActivationsPerLayerEachWay) {
  if (g_env->comm->world_size() < 2) GTEST_SKIP() << "needs mpirun -np 2, 4 or 8";
  ProcessGroups g = std::move(groups().front());
  const ModelConfig cfg = parse_model_config(kLlama, "test config");
  for (const bool ckpt : {false, true}) {
    const Model::TpTraffic t = step_traffic(*g.tp, ckpt, false);
    const std::uint64_t L = std::uint64_t(cfg.num_layers), act = kB * kT * cfg.hidden_size * 4;
    const std::uint64_t per_layer = ckpt ? 5 : 4, chunks = (kB * kT + 4) / 5;
    EXPECT_EQ(t.all_reduces, per_layer * L + 2) << "checkpointed: " << ckpt;
    EXPECT_EQ(t.all_reduce_bytes, (per_layer * L + 2) * act);
    EXPECT_EQ(t.all_gathers, chunks);
    EXPECT_EQ(t.all_gather_bytes, std::uint64_t(kB * kT) * 2 * 4);
  }
}

// ---- the engine over the data-parallel group ----

struct Trained {
  std::vector<double> losses, norms;
  std::vector<std::vector<float>>
      units;  // the fp32 master weights, each unit whole (this TP slice)
};

constexpr int kSteps = 3;

// Micro-batch `a` of data-parallel rank `d` (kB rows, the same every step); `ranks` of them side by
// side as one batch of ranks x kB rows (the reference's).
Batch step_batch(std::int64_t vocab, int a, int d, int ranks) {
  Batch out;
  for (int q = d; q < d + ranks; ++q) {
    std::mt19937_64 rng(std::uint64_t(10 * a + q));  // the same every step: the loss must fall
    for (std::int64_t i = 0; i < kB * kT; ++i) {
      out.tokens.push_back(static_cast<std::int32_t>(rng() % vocab));
      out.targets.push_back(static_cast<std::int32_t>(rng() % vocab));
    }
  }
  return out;
}

// `dp` ranks (this one `dp.rank()`), each kB rows a micro-batch, or (dp of one, `rows_of` ranks)
// the reference with all their rows in each micro-batch.
Trained train_engine(const ModelConfig& cfg, Device& dev, Communicator& dp, Communicator* tp,
                     EngineConfig ec, int rows_of = 1) {
  constexpr int kAccum = 2;
  auto s = dev.create_stream("compute");
  ModelOptions mo;
  mo.micro_batch = kB * rows_of;
  mo.seq_len = kT;
  mo.tensor_parallel = tp;
  Model m(cfg, dev, *s, mo);
  ec.gradient_accumulation_steps = kAccum;
  ec.gradient_clipping = 0.05;  // below the norms: every step clips, by the global norm
  ec.adamw.eps = 1e-4f;         // see engine_mpi_test.cpp
  ec.host_budget_bytes = 64 << 20;
  Engine e(dev, dp, ec);
  const TensorParallel t = m.tensor_parallel();
  add_model_units(e, m.units(), fresh_model_source(cfg, 5, t));
  if (tp) e.set_tensor_parallel(*tp, tensor_parallel_counted(m.units(), t.rank));
  e.finalize();
  EngineWeights w(e, *s, m.units());
  Trained out;
  for (int step = 0; step < kSteps; ++step) {
    double loss = 0;
    for (int a = 0; a < kAccum; ++a) {
      loss += m.forward(step_batch(cfg.vocab_size, a, dp.rank(), rows_of), w) / kAccum;
      m.backward(w);
      s->synchronize();
    }
    const StepResult r = e.step(1e-2f);
    out.losses.push_back(loss);  // this DP rank's; the reference's is every rank's mean
    out.norms.push_back(r.grad_norm);
  }
  for (std::size_t u = 0; u < m.units().size(); ++u) out.units.push_back(e.gather_master(int(u)));
  return out;
}

void compare_engine(EngineConfig ec, const std::string& what,
                    const std::function<void(EngineConfig&, const std::string&)>& paths = {}) {
  for (const char* json : {kLlama, kGpt2}) {
    const ModelConfig cfg = parse_model_config(json, "test config");
    for (ProcessGroups& g : groups()) {
      SCOPED_TRACE(what + ", " + cfg.model_type + ", TP " + std::to_string(g.tp_size) + " x DP " +
                   std::to_string(g.dp_size));
      EngineConfig mine = ec, ref = ec;
      if (paths) {
        paths(mine, "rank" + std::to_string(g_env->comm->rank()));
        paths(ref, "reference-of-rank" + std::to_string(g_env->comm->rank()));
      }
      const Trained got = train_engine(cfg, *g_env->dev, *g.dp, g.tp.get(), mine);
      auto dev1 = make_host_device();
      CommOptions co;
      co.backend = CommBackend::kLocal;
      co.process_local = true;
      auto local = make_communicator(*dev1, co);
      const Trained want = train_engine(cfg, *dev1, *local, nullptr, ref, g.dp_size);
      for (int i = 0; i < kSteps; ++i) {
        // The step's loss over the DP group: the mean of its ranks' (equal rows, none ignored).
        const std::vector<float> losses = gathered(*g.dp, {float(got.losses[std::size_t(i)])});
        double mean = 0;
        for (float l : losses) mean += l / double(losses.size());
        EXPECT_NEAR(mean, want.losses[std::size_t(i)], 2e-6 * want.losses[std::size_t(i)])
            << "step " << i;
        EXPECT_NEAR(got.norms[std::size_t(i)], want.norms[std::size_t(i)],
                    2e-5 * want.norms[std::size_t(i)])
            << "step " << i << "'s gradient norm";
      }
      EXPECT_LT(want.losses.back(), want.losses.front()) << "did not train";
      const std::vector<UnitSpec> full = model_units(cfg);
      const std::vector<UnitSpec> slices = model_units(cfg, {g.tp_size, g.tp_rank});
      for (std::size_t u = 0; u < full.size(); ++u)
        for (std::size_t k = 0; k < full[u].params.size(); ++k) {
          const ParamSpec &f = full[u].params[k], &p = slices[u].params[k];
          const auto at = [](const std::vector<float>& flat, const ParamSpec& q) {
            return std::vector<float>(flat.begin() + std::ptrdiff_t(q.offset),
                                      flat.begin() + std::ptrdiff_t(q.offset + q.numel));
          };
          const std::vector<float> mine_w = at(got.units[u], p);
          const std::vector<float> want_w = tp_slice(p, at(want.units[u], f));
          float worst = 0;
          for (std::size_t e = 0; e < want_w.size(); ++e)
            worst =
                std::max(worst, std::fabs(mine_w[e] - want_w[e]) / (1e-3f + std::fabs(want_w[e])));
          EXPECT_LE(worst, 2e-4) << p.name;
          if (!p.split()) {
            EXPECT_TRUE(equal_on_every_rank(*g.tp, mine_w))
                << p.name << ": the TP ranks' replicas differ";
          }
        }
    }
  }
}

Placement on(Tier t) {
  Placement p;
  p.device_fraction = t == Tier::kDevice ? 1 : 0;
  p.host_fraction = t == Tier::kHost ? 1 : 0;
  return p;
}

TEST(EngineTp, ZeroThreeOverTheDataParallelGroupEqualsTheWholeModelOnOneRank) {
  if (g_env->comm->world_size() < 2) GTEST_SKIP() << "needs mpirun -np 2, 4 or 8";
  EngineConfig c = default_engine_config();
  c.param_persistence_threshold = 0;  // every unit gathered over the DP group at each use
  compare_engine(c, "on the device");
}

// The split weights' memory: each TP rank's engine plans, and holds on the device once finalized,
// 1/TP of what the whole model's engine does (a model whose replicated norms and unit padding are
// small beside its matrices), and the plan and the measurement agree.
TEST(EngineTp, EachRankPlansAndHoldsItsShareOfTheWeights) {
  if (g_env->comm->world_size() < 2) GTEST_SKIP() << "needs mpirun -np 2, 4 or 8";
  const ModelConfig cfg = parse_model_config(
      R"({"model_type": "llama", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 1024,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4})",
      "test config");
  struct Held {
    std::uint64_t planned = 0, measured = 0;
  };
  auto hold = [&](Device& dev, Communicator& dp, Communicator* tp, TensorParallel t) {
    EngineConfig ec = default_engine_config();  // everything on the device
    ec.host_budget_bytes = 64 << 20;
    const std::size_t before = dev.stats().bytes_in_use;
    Held h;
    {
      Engine e(dev, dp, ec);
      const std::vector<UnitSpec> units = model_units(cfg, t);
      add_model_units(e, units, fresh_model_source(cfg, 5, t));
      if (tp) e.set_tensor_parallel(*tp, tensor_parallel_counted(units, t.rank));
      e.finalize();
      h.measured = dev.stats().bytes_in_use - before;
      // What the plan holds from finalize() on: all but the backward's unit gradients.
      for (const PlanLine& l : e.plan().lines)
        if (l.tier == Tier::kDevice && l.what.find("unit gradients") == std::string::npos)
          h.planned += l.bytes;
    }
    return h;
  };
  for (ProcessGroups& g : groups()) {  // TP 2; TP 4 and TP 2 x DP 2; TP 4 x DP 2
    SCOPED_TRACE("TP " + std::to_string(g.tp_size) + " x DP " + std::to_string(g.dp_size));
    const Held mine = hold(*g_env->dev, *g.dp, g.tp.get(), {g.tp_size, g.tp_rank});
    // The reference: the whole model over the same DP group (TP 1).
    const Held whole = hold(*g_env->dev, *g.dp, nullptr, {});
    const double share = 1.0 / g.tp_size;
    // Within 2% of 1/TP; 5% over DP 2, where a unit under param_persistence_threshold stays whole
    // on every DP rank and TP 4's slices of the embedding and the head fall under it while the
    // whole ones do not (the bytes held at finalize 3.8% over 1/TP at TP 4 x DP 2).
    const double tol = (g.dp_size == 1 ? 0.02 : 0.05) * share;
    ASSERT_GT(whole.planned, 0u);
    EXPECT_NEAR(double(mine.planned) / double(whole.planned), share, tol);
    EXPECT_NEAR(double(mine.measured) / double(whole.measured), share, tol);
    if (g.dp_size == 1) {  // every unit resident from finalize() on: the plan is what is held
      EXPECT_NEAR(double(mine.measured), double(mine.planned), 0.01 * double(mine.planned));
      EXPECT_NEAR(double(whole.measured), double(whole.planned), 0.01 * double(whole.planned));
    } else {  // ZeRO-3 over DP: the plan also holds the gathered units a step fetches
      EXPECT_LE(mine.measured, mine.planned);
      EXPECT_LE(whole.measured, whole.planned);
    }
  }
}

TEST(EngineTp, OffloadedToHostAndNvmeEqualsTheWholeModelOnOneRank) {
  if (g_env->comm->world_size() < 2) GTEST_SKIP() << "needs mpirun -np 2, 4 or 8";
  namespace fs = std::filesystem;
  const strata::testing::TempDir tmp("strata-model-tp");  // this rank's, removed with it
  const fs::path dir = tmp.path;
  EngineConfig c = default_engine_config();
  c.param_persistence_threshold = 0;
  c.params = on(Tier::kNvme);
  c.optimizer = on(Tier::kHost);
  c.grads = on(Tier::kNvme);  // the norm's counted ranges taken as the gradients go out
  const auto paths = [&](EngineConfig& e, const std::string& who) {
    const std::string d = (dir / who).string();
    fs::create_directories(d);
    e.param_nvme_paths = {d};
    e.grad_nvme_paths = {d};
  };
  compare_engine(c, "params and gradients on NVMe, optimizer on the host", paths);
  c.grads = on(Tier::kHost);
  c.optimizer = on(Tier::kNvme);
  c.overlap_optimizer = true;  // kept or redone by the global (TP) norm alike on every rank
  const auto opt_paths = [&](EngineConfig& e, const std::string& who) {
    paths(e, who);
    e.optimizer_nvme_paths = e.param_nvme_paths;
  };
  compare_engine(c, "gradients on the host, optimizer on NVMe, early optimizer step", opt_paths);
}

}  // namespace
}  // namespace strata

int main(int argc, char** argv) {
  using namespace strata;
  ::testing::InitGoogleTest(&argc, argv);
  strata::testing::RankEnv env;
  // Random delays: the collectives must be ordered on the streams that use their buffers.
  if (!strata::testing::open_rank_env(env, std::size_t(256) << 20, 20, "model_tp_test")) return 1;
  g_env = &env;
  return strata::testing::run_tests_on_rank(env.launch.rank, "model_tp_test");
}
