// Megatron tensor parallelism in the model, under mpirun (MPI on the CPU-emulated device): the
// ranks of a TP group each run the same batch with their slice of every split layer, and every rank
// also runs the whole model (TP 1) alone as the reference. The TP ranks' loss must equal the
// reference's, and each rank's gradients the reference's gradients' slice of that rank, to fp32
// rounding (the row-parallel sums and the vocabulary-parallel log-sum-exp run in another order);
// the replicated parameters' gradients and the loss must be bitwise equal on every TP rank (the
// replicas stay equal without a reduction). With 4 ranks: TP 4, and TP 2 x DP 2 (two TP groups
// side by side, from make_process_groups).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>

#include "strata/comm.h"
#include "strata/error.h"
#include "strata/model.h"

namespace strata {
namespace {

struct Env {
  LaunchInfo launch;
  std::unique_ptr<Device> dev;
  std::unique_ptr<Communicator> world;
};
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

// The TP groups a test runs: the whole world, and with 4 ranks also TP 2 x DP 2.
std::vector<ProcessGroups> groups() {
  std::vector<ProcessGroups> out;
  out.push_back(make_process_groups(*g_env->world, g_env->world->world_size()));
  if (g_env->world->world_size() == 4) out.push_back(make_process_groups(*g_env->world, 2));
  return out;
}

class ModelTp : public ::testing::TestWithParam<Case> {};

TEST_P(ModelTp, EqualsOneRankWithTheWholeModel) {
  if (g_env->world->world_size() < 2) GTEST_SKIP() << "needs mpirun -np 2 or 4";
  for (ProcessGroups& g : groups()) {
    SCOPED_TRACE("TP " + std::to_string(g.tp_size) + " x DP " + std::to_string(g.dp_size));
    check_case(GetParam(), *g.tp);
  }
}

INSTANTIATE_TEST_SUITE_P(Families, ModelTp,
                         ::testing::Values(Case{kLlama}, Case{kGpt2}, Case{kLlama, DType::kBF16},
                                           Case{kGpt2, DType::kBF16},
                                           Case{kLlama, DType::kF32, true, true},
                                           Case{kGpt2, DType::kF32, true, true}),
                         [](const ::testing::TestParamInfo<Case>& i) {
                           std::string n = i.param.cfg == kLlama ? "LlamaGqa" : "Gpt2";
                           n += i.param.dtype == DType::kBF16 ? "Bf16" : "Fp32";
                           if (i.param.checkpoint) n += "CheckpointedPacked";
                           return n;
                         });

// Decoding with the key/value cache: the TP ranks' logits of each new token equal the whole
// model's.
TEST(ModelTpDecode, CachedDecodingEqualsTheWholeModel) {
  if (g_env->world->world_size() < 2) GTEST_SKIP() << "needs mpirun -np 2 or 4";
  ProcessGroups g = make_process_groups(*g_env->world, g_env->world->world_size());
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

}  // namespace
}  // namespace strata

int main(int argc, char** argv) {
  using namespace strata;
  ::testing::InitGoogleTest(&argc, argv);
  Env env;
  try {
    env.launch = init_launch();
    HostDeviceOptions o;
    o.capacity_bytes = std::size_t(256) << 20;
    o.random_delay_us = 20;  // the collectives must be ordered on the model's stream
    env.dev = make_host_device(o);
    env.world = make_communicator(*env.dev);
  } catch (const Error& e) {
    std::fprintf(stderr, "model_tp_test: %s\n", e.what());
    return 1;
  }
  g_env = &env;
  if (env.launch.rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  const int rc = RUN_ALL_TESTS();
  if (rc != 0) std::fprintf(stderr, "model_tp_test: rank %d failed\n", env.launch.rank);
  return rc;
}
