// Model behaviour that needs no oracle: activation checkpointing (device and host) gives
// bit-identical gradients, the chunked fused LM-head loss equals the loss of the full logits,
// gradients accumulate, the provider contract is checked, and bad input gives named errors.
#include "strata/model.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <tuple>

#include "strata/error.h"

namespace strata {
namespace {

const char* kLlama =
    R"({"model_type": "llama", "vocab_size": 67, "hidden_size": 32, "intermediate_size": 40,
  "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32})";
const char* kGpt2 =
    R"({"model_type": "gpt2", "vocab_size": 71, "n_embd": 24, "n_layer": 2, "n_head": 2,
  "n_positions": 16})";

Batch random_batch(std::int64_t n, std::int64_t vocab, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  Batch b;
  for (std::int64_t i = 0; i < n; ++i) {
    b.tokens.push_back(static_cast<std::int32_t>(rng() % vocab));
    b.targets.push_back(static_cast<std::int32_t>(rng() % vocab));
  }
  return b;
}

std::vector<std::vector<float>> all_grads(const ResidentWeights& w) {
  std::vector<std::vector<float>> out;
  for (const auto& u : w.units())
    for (const auto& p : u.params) out.push_back(w.grad(p.name));
  return out;
}

struct StepResult {
  float loss;
  std::vector<std::vector<float>> grads;
};

StepResult train_step(const char* cfg_json, bool ckpt, bool host, DType dt = DType::kF32,
                      int micro_batches = 1, std::int64_t seq = 7) {
  const ModelConfig cfg = parse_model_config(cfg_json, "test config");
  HostDeviceOptions ho;
  ho.capacity_bytes = std::size_t(256) << 20;
  ho.random_delay_us = 20;  // expose missing stream ordering (host checkpoint copies)
  auto dev = make_host_device(ho);
  auto s = dev->create_stream("model");
  ModelOptions mo;
  mo.micro_batch = 2;
  mo.seq_len = seq;
  mo.compute = dt;
  mo.checkpoint = ckpt;
  mo.checkpoint_on_host = host;
  Model m(cfg, *dev, *s, mo);
  ResidentWeights w(m, *s);
  w.init_random(3, 0.3f);
  w.zero_grads();
  float loss = 0;
  for (int i = 0; i < micro_batches; ++i) {
    loss = m.forward(random_batch(2 * seq, cfg.vocab_size, 9 + i), w);
    m.backward(w);
  }
  s->synchronize();
  return {loss, all_grads(w)};
}

class Families : public ::testing::TestWithParam<const char*> {};

TEST_P(Families, CheckpointingGivesBitIdenticalGradients) {
  const StepResult plain = train_step(GetParam(), false, false);
  const StepResult dev_ckpt = train_step(GetParam(), true, false);
  const StepResult host_ckpt = train_step(GetParam(), true, true);
  EXPECT_EQ(plain.loss, dev_ckpt.loss);
  EXPECT_EQ(plain.loss, host_ckpt.loss);
  ASSERT_EQ(plain.grads.size(), dev_ckpt.grads.size());
  for (std::size_t i = 0; i < plain.grads.size(); ++i) {
    EXPECT_EQ(plain.grads[i], dev_ckpt.grads[i]) << "parameter " << i;
    EXPECT_EQ(plain.grads[i], host_ckpt.grads[i]) << "parameter " << i;
  }
}

TEST_P(Families, GradientsAccumulateOverMicroBatches) {
  const StepResult one = train_step(GetParam(), false, false, DType::kF32, 1);
  const StepResult two = train_step(GetParam(), false, false, DType::kF32, 2);
  // The second micro-batch adds to the first: the sums differ from one batch's gradients.
  std::size_t differing = 0;
  for (std::size_t i = 0; i < one.grads.size(); ++i) differing += one.grads[i] != two.grads[i];
  EXPECT_EQ(differing, one.grads.size());
}

TEST_P(Families, Bf16IsCloseToFp32) {
  const StepResult f = train_step(GetParam(), false, false, DType::kF32);
  const StepResult b = train_step(GetParam(), false, false, DType::kBF16);
  EXPECT_NEAR(f.loss, b.loss, 0.03 * f.loss);
}

INSTANTIATE_TEST_SUITE_P(Model, Families, ::testing::Values(kLlama, kGpt2),
                         [](const auto& i) { return i.index == 0 ? "llama" : "gpt2"; });

TEST(Model, ChunkedFusedLossEqualsLossOfFullLogits) {
  const ModelConfig cfg = parse_model_config(kLlama, "test");
  auto dev = make_host_device();
  auto s = dev->create_stream("model");
  for (std::int64_t chunk : {1, 5, 0}) {
    ModelOptions mo;
    mo.micro_batch = 3;
    mo.seq_len = 5;
    mo.loss_chunk_rows = chunk;
    Model m(cfg, *dev, *s, mo);
    ResidentWeights w(m, *s);
    w.init_random(4, 0.3f);
    const Batch b = random_batch(15, cfg.vocab_size, 2);
    const std::vector<float> logits = m.logits(b.tokens, w);
    double ref = 0;
    for (std::size_t r = 0; r < 15; ++r) {
      double mx = -1e30, sum = 0;
      for (std::int64_t i = 0; i < cfg.vocab_size; ++i)
        mx = std::max<double>(mx, logits[r * cfg.vocab_size + i]);
      for (std::int64_t i = 0; i < cfg.vocab_size; ++i)
        sum += std::exp(logits[r * cfg.vocab_size + i] - mx);
      ref += mx + std::log(sum) - logits[r * cfg.vocab_size + b.targets[r]];
    }
    ref /= 15;
    EXPECT_NEAR(m.forward(b, w, false), ref, 1e-5) << "chunk " << chunk;
  }
}

TEST(Model, UnitsAreEmbeddingLayersHead) {
  const ModelConfig cfg = parse_model_config(kLlama, "test");
  const auto units = model_units(cfg);
  ASSERT_EQ(units.size(), 5u);
  EXPECT_EQ(units[0].name, "embed");
  EXPECT_EQ(units[2].name, "layers.1");
  EXPECT_EQ(units[4].name, "head");
  EXPECT_EQ(units[4].params.back().name, "lm_head.weight");
  // q, k, v adjacent (one fused GEMM), as are gate and up.
  const auto& p = units[1].params;
  EXPECT_EQ(p[2].offset, p[1].offset + p[1].numel);
  EXPECT_EQ(p[3].offset, p[2].offset + p[2].numel);
  EXPECT_EQ(p[1].shape, (std::vector<std::int64_t>{32, 32}));
  EXPECT_EQ(p[2].shape, (std::vector<std::int64_t>{16, 32}));
}

// A parameter's initial values made on every core (blocks of 65536) are those made one element at
// a time: each a function of its index alone, the same bits however they are cut.
TEST(Model, InitialValuesOnEveryCoreAreTheSequentialOnes) {
  const ModelConfig cfg = parse_model_config(
      R"({"model_type": "llama", "vocab_size": 4000, "hidden_size": 64, "intermediate_size": 128,
      "num_hidden_layers": 1, "num_attention_heads": 4})",
      "wide embedding");
  const std::vector<UnitSpec> units = model_units(cfg);
  const ParamSpec& embed = units[0].params[0];
  ASSERT_GT(embed.numel, std::size_t(3) << 16);
  std::vector<float> whole(embed.numel), pieces(embed.numel);
  init_hf_values(cfg, embed, 9, 0, embed.numel, whole.data());
  for (std::size_t first = 0; first < embed.numel; first += 777)
    init_hf_values(cfg, embed, 9, first, std::min<std::size_t>(777, embed.numel - first),
                   pieces.data() + first);
  EXPECT_EQ(std::memcmp(whole.data(), pieces.data(), whole.size() * 4), 0);
  std::vector<float> tail(1000);  // from an offset that is no block's start
  init_hf_values(cfg, embed, 9, 100001, tail.size(), tail.data());
  EXPECT_EQ(std::memcmp(tail.data(), whole.data() + 100001, tail.size() * 4), 0);
}

// Llama's attention_bias gives o_proj a bias too (Hugging Face's LlamaAttention): it is in the
// layout, and it moves the logits.
TEST(Model, LlamaAttentionBiasIncludesOutputProjectionBias) {
  const std::string json = std::string(kLlama).insert(1, R"("attention_bias": true, )");
  const ModelConfig cfg = parse_model_config(json, "test");
  auto dev = make_host_device();
  auto s = dev->create_stream("model");
  Model m(cfg, *dev, *s, {.micro_batch = 1, .seq_len = 5});
  ResidentWeights w(m, *s);
  w.init_random(4, 0.3f);
  const std::string ob = "model.layers.1.self_attn.o_proj.bias";
  ASSERT_NO_THROW(w.find(ob)) << "o_proj.bias is not in the layout";
  EXPECT_NO_THROW(w.find("model.layers.1.self_attn.q_proj.bias"));
  const std::vector<std::int32_t> ids = random_batch(5, cfg.vocab_size, 2).tokens;
  w.set(ob, std::vector<float>(32, 0.0f));
  const std::vector<float> base = m.logits(ids, w);
  w.set(ob, std::vector<float>(32, 0.5f));
  EXPECT_NE(m.logits(ids, w), base) << "o_proj.bias does not reach the output";
}

// GPT-2's scale_attn_weights / scale_attn_by_inverse_layer_idx change only the attention
// scale, so a model with them equals the default model with each layer's q columns (weight
// and bias) multiplied by the scale ratio.
TEST(Model, Gpt2AttentionScaleOptionsEqualScaledQueries) {
  const ModelConfig plain = parse_model_config(kGpt2, "test");
  const std::int64_t C = 24, hd = 12;
  auto dev = make_host_device();
  auto s = dev->create_stream("model");
  const std::vector<std::int32_t> ids = random_batch(6, plain.vocab_size, 3).tokens;
  const std::tuple<const char*, bool, bool> cases[] = {
      {R"("scale_attn_by_inverse_layer_idx": true, )", true, false},
      {R"("scale_attn_weights": false, )", false, true},
      {R"("scale_attn_weights": false, "scale_attn_by_inverse_layer_idx": true, )", true, true}};
  for (const auto& [keys, by_layer, unscaled] : cases) {
    const ModelConfig cfg = parse_model_config(std::string(kGpt2).insert(1, keys), keys);
    Model a(cfg, *dev, *s, {.micro_batch = 1, .seq_len = 6});
    Model b(plain, *dev, *s, {.micro_batch = 1, .seq_len = 6});
    ResidentWeights wa(a, *s), wb(b, *s);
    wa.init_random(6, 0.3f);
    wb.init_random(6, 0.3f);
    for (int l = 0; l < 2; ++l) {
      const double f = (unscaled ? std::sqrt(double(hd)) : 1.0) / (by_layer ? l + 1 : 1);
      const std::string p = fmt::format("transformer.h.{}.attn.c_attn.", l);
      std::vector<float> wq = wb.get(p + "weight"), bq = wb.get(p + "bias");
      for (std::int64_t i = 0; i < C; ++i)
        for (std::int64_t j = 0; j < C; ++j) wq[i * 3 * C + j] = float(wq[i * 3 * C + j] * f);
      for (std::int64_t j = 0; j < C; ++j) bq[j] = float(bq[j] * f);
      wb.set(p + "weight", wq);
      wb.set(p + "bias", bq);
    }
    const std::vector<float> la = a.logits(ids, wa), lb = b.logits(ids, wb);
    ASSERT_EQ(la.size(), lb.size());
    double worst = 0, scale = 0;
    for (std::size_t i = 0; i < la.size(); ++i) {
      worst = std::max(worst, std::fabs(double(la[i]) - lb[i]));
      scale = std::max(scale, std::fabs(double(lb[i])));
    }
    EXPECT_LT(worst, 1e-5 * scale) << keys;
  }
}

// Hugging Face's Qwen2Config defaults use_sliding_window to false; Mistral's window always binds
// (use_sliding_window true and false: BadInputNamesTheProblem).
TEST(Model, Qwen2SlidingWindowIsOffUnlessEnabled) {
  const char* shape =
      R"("vocab_size": 50, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 1, "sliding_window": 32})";
  auto dev = make_host_device();
  auto s = dev->create_stream("model");
  const ModelConfig q =
      parse_model_config(std::string(R"({"model_type": "qwen2", )") + shape, "qwen2");
  EXPECT_NO_THROW(Model(q, *dev, *s, {.micro_batch = 1, .seq_len = 64}));
  const ModelConfig mi =
      parse_model_config(std::string(R"({"model_type": "mistral", )") + shape, "mistral");
  EXPECT_THROW(Model(mi, *dev, *s, {.micro_batch = 1, .seq_len = 64}), Error);
}

// A config.json with a key twice is read as transformers reads it (Python's json: the last one
// wins); a DeepSpeed config is refused instead (EngineConfig.ErrorsNameTheKeyAndTheAllowedValues).
TEST(Model, AConfigJsonKeyGivenTwiceTakesTheLast) {
  const ModelConfig c = parse_model_config(
      R"({"model_type": "llama", "vocab_size": 50, "hidden_size": 16, "intermediate_size": 32,
          "num_hidden_layers": 1, "num_attention_heads": 2, "num_attention_heads": 4})",
      "twice");
  EXPECT_EQ(c.num_heads, 4);
}

void expect_error(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(Model, BadInputNamesTheProblem) {
  auto dev = make_host_device();
  auto s = dev->create_stream("model");
  const ModelConfig cfg = parse_model_config(kGpt2, "test");
  ModelOptions mo;
  mo.micro_batch = 1;
  mo.seq_len = 4;
  Model m(cfg, *dev, *s, mo);
  ResidentWeights w(m, *s);
  Batch b = random_batch(4, cfg.vocab_size, 1);
  b.tokens[2] = 71;
  expect_error([&] { m.forward(b, w); }, "batch.tokens[2] = 71");
  b.tokens[2] = 0;
  b.targets.pop_back();
  expect_error([&] { m.forward(b, w); }, "batch.targets has 3 ids");
  expect_error([&] { m.backward(w); }, "call forward");
  mo.seq_len = 17;
  expect_error([&] { Model big(cfg, *dev, *s, mo); }, "n_positions 16");
  // A sliding window binds only when used (Qwen2's configs say "use_sliding_window": false).
  const auto windowed = [](const char* use) {
    return parse_model_config(
        std::string(R"({"model_type": "qwen2", "vocab_size": 67, "hidden_size": 32,
      "intermediate_size": 40, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
      "max_position_embeddings": 64, "sliding_window": 8)") +
            use + "}",
        "qwen2.json");
  };
  expect_error(
      [&] { Model windowed_model(windowed(R"(, "use_sliding_window": true)"), *dev, *s, mo); },
      "sliding_window 8");
  Model unwindowed(windowed(R"(, "use_sliding_window": false)"), *dev, *s, mo);
  expect_error([&] { parse_model_config("{\"model_type\": \"llama\"}", "cfg.json"); },
               "'vocab_size' is missing");
  expect_error([&] { parse_model_config("{\"model_type\": \"bert\"}", "cfg.json"); }, "bert");
  expect_error([&] { parse_model_config("{not json", "my/config.json"); }, "my/config.json");
  expect_error([&] { load_model_config("/nonexistent/config.json"); }, "/nonexistent/config.json");
  expect_error(
      [&] {
        parse_model_config(
            R"({"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
          "num_hidden_layers": 1, "num_attention_heads": 3, "num_key_value_heads": 2})",
            "c.json");
      },
      "not a multiple");
}

// Tensor-parallel layouts: each rank's slices of a split tensor tile it exactly once (GPT-2's
// fused q|k|v by part, the vocabulary unevenly), replicated tensors are whole on every rank,
// from-scratch values are the whole model's at the same elements, and a TP size that does not
// divide what it splits is refused naming it.
TEST(ModelTpLayout, SlicesTileEachTensorOnceAndSizesThatDoNotDivideAreRefused) {
  for (const char* json : {kLlama, kGpt2}) {
    const ModelConfig cfg = parse_model_config(json, "test");
    const std::vector<UnitSpec> full = model_units(cfg);
    const int n = 2;
    std::vector<std::vector<UnitSpec>> ranks;
    for (int r = 0; r < n; ++r) ranks.push_back(model_units(cfg, {n, r}));
    for (std::size_t u = 0; u < full.size(); ++u)
      for (std::size_t k = 0; k < full[u].params.size(); ++k) {
        const ParamSpec& f = full[u].params[k];
        std::vector<float> iota(f.numel), covered(f.numel, 0.0f);
        for (std::size_t e = 0; e < f.numel; ++e) iota[e] = float(e);
        std::size_t held = 0;
        for (int r = 0; r < n; ++r) {
          const ParamSpec& p = ranks[std::size_t(r)][u].params[k];
          ASSERT_EQ(p.name, f.name);
          EXPECT_EQ(p.full_shape, f.shape);
          const std::vector<float> slice = tp_slice(p, iota);
          if (!p.split()) {
            EXPECT_EQ(slice, iota) << p.name;
            continue;
          }
          held += p.numel;
          std::vector<float> ones(p.numel, 1.0f), mark(f.numel, 0.0f);
          tp_place(p, ones, mark);
          for (std::size_t e = 0; e < f.numel; ++e) covered[e] += mark[e];
          std::vector<float> back(f.numel, -1.0f);
          tp_place(p, slice, back);
          for (std::size_t e = 0; e < f.numel; ++e)
            if (back[e] >= 0) {
              EXPECT_EQ(back[e], iota[e]) << p.name;
            }
          // The runs a streamed load reads: consecutive in the full tensor, each as long as
          // that allows (the next element starts elsewhere), tiling the slice.
          EXPECT_EQ(p.full_numel(), f.numel) << p.name;
          for (std::size_t i = 0; i < p.numel;) {
            const std::size_t run = p.contiguous_from(i);
            ASSERT_GT(run, 0u) << p.name << " at " << i;
            for (std::size_t k = 1; k < run; ++k)
              ASSERT_EQ(p.full_index(i + k), p.full_index(i) + k) << p.name << " at " << i + k;
            if (i + run < p.numel) {
              EXPECT_NE(p.full_index(i + run), p.full_index(i + run - 1) + 1) << p.name;
            }
            i += run;
          }
          EXPECT_EQ(p.contiguous_from(p.numel), 0u);
          std::vector<float> mine(p.numel), whole(f.numel);
          init_hf_values(cfg, p, 5, 0, p.numel, mine.data());
          init_hf_values(cfg, f, 5, 0, f.numel, whole.data());
          EXPECT_EQ(mine, tp_slice(p, whole)) << p.name;
        }
        if (held > 0) {
          EXPECT_EQ(held, f.numel) << f.name;
          EXPECT_EQ(*std::min_element(covered.begin(), covered.end()), 1.0f) << f.name;
          EXPECT_EQ(*std::max_element(covered.begin(), covered.end()), 1.0f) << f.name;
        }
      }
  }
  // The vocabulary 67 over 2: 34 rows and 33.
  const ModelConfig llama = parse_model_config(kLlama, "test");
  EXPECT_EQ(model_units(llama, {2, 0})[0].params[0].shape[0], 34);
  EXPECT_EQ(model_units(llama, {2, 1})[0].params[0].shape[0], 33);
  EXPECT_EQ(model_units(llama, {2, 1})[0].params[0].split_begin, 34);
  // 4 heads, 2 key/value heads, MLP 40.
  expect_error([&] { model_units(llama, {3, 0}); }, "does not divide the model's attention heads");
  expect_error([&] { model_units(llama, {4, 0}); }, "key/value heads (num_key_value_heads) (2)");
  std::string odd = kLlama;
  const std::string width = "\"intermediate_size\": 40";
  odd.replace(odd.find(width), width.size(), "\"intermediate_size\": 41");
  expect_error([&] { model_units(parse_model_config(odd, "test"), {4, 0}); }, "key/value heads");
  expect_error(
      [&] {
        model_units(parse_model_config(odd, "test"), {2, 0});
      },
      "MLP width (intermediate_size) (41)");
  const ModelConfig tiny = parse_model_config(
      R"({"model_type": "llama", "vocab_size": 5, "hidden_size": 16, "intermediate_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4})",
      "test");
  expect_error([&] { model_units(tiny, {4, 0}); }, "leaves TP rank 3 no vocabulary rows");
  // The size it suggests splits the heads too (it said "at most 3", which 4 heads refuse).
  const ModelConfig three = parse_model_config(
      R"({"model_type": "llama", "vocab_size": 3, "hidden_size": 16, "intermediate_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4})",
      "test");
  expect_error(
      [&] {
        model_units(three, {4, 0});
      },
      "use a smaller TP size (2 is the largest that splits this model)");
  // A GPT-2's are named by its own config.json keys (they were Llama's).
  const ModelConfig gpt2 = parse_model_config(
      R"({"model_type": "gpt2", "vocab_size": 64, "n_embd": 64, "n_layer": 1, "n_head": 4,
        "n_positions": 32, "n_inner": 102})",
      "test");
  expect_error([&] { model_units(gpt2, {3, 0}); }, "attention heads (n_head) (4)");
  expect_error([&] { model_units(gpt2, {8, 0}); }, "attention heads (n_head) (4)");
  expect_error([&] { model_units(gpt2, {4, 0}); }, "MLP width (n_inner, default 4 x n_embd) (102)");
  expect_error([&] { model_units(tiny, {2, 2}); }, "rank 2 of 2 is not a rank of the group");
}

}  // namespace
}  // namespace strata
