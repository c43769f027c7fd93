// Supervised fine-tuning inputs in the model: targets masked with kIgnoreTarget and packed rows
// (Batch::positions), without an oracle (model_oracle_test compares both with PyTorch).
//
//  - A packed row (several documents, positions restarting at each) gives the loss and every
//    gradient of the same documents run as rows of their own, padded with ignored targets.
//    Tolerance: fp32 5e-6 of each tensor's largest magnitude (the GEMMs and the column sums run
//    over other row counts, so only the order of the sums differs; measured worst 8e-8); bf16
//    compute 1e-3 (a sum's last bit can flip a bf16 rounding downstream; measured worst 1.5e-7).
//  - Masked targets add nothing: the loss is the mean over the counted targets of the log-softmax
//    of Model::logits, perturbing the masked targets changes no bit, and dropping the mask does
//    change the loss.
//  - loss_denominator scales the loss and every gradient (by a power of two: exactly).
//  - Bad positions and a batch whose every target is masked are errors naming the problem.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>

#include "strata/error.h"
#include "strata/model.h"

namespace strata {
namespace {

const char* kLlamaGqa =
    R"({"model_type": "llama", "vocab_size": 67, "hidden_size": 32, "intermediate_size": 40,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32})";
const char* kGpt2 =
    R"({"model_type": "gpt2", "vocab_size": 71, "n_embd": 24, "n_layer": 2, "n_head": 2,
  "n_positions": 16})";

constexpr std::int64_t kT = 16;

struct Result {
  float loss = 0;
  std::vector<std::vector<float>> grads;
};

struct Fixture {
  ModelConfig cfg;
  std::unique_ptr<Device> dev;
  std::unique_ptr<Stream> s;
  std::unique_ptr<Model> m;
  std::unique_ptr<ResidentWeights> w;

  Fixture(const char* json, std::int64_t batch, DType dt = DType::kF32, bool ckpt = false)
      : cfg(parse_model_config(json, "test config")), dev(make_host_device()) {
    s = dev->create_stream("model");
    ModelOptions mo;
    mo.micro_batch = batch;
    mo.seq_len = kT;
    mo.compute = dt;
    mo.checkpoint = ckpt;
    mo.loss_chunk_rows = 5;
    m = std::make_unique<Model>(cfg, *dev, *s, mo);
    w = std::make_unique<ResidentWeights>(*m, *s);
    w->init_random(7, 0.3f);
  }
  Result step(const Batch& b, double den = 0) {
    w->zero_grads();
    Result r;
    r.loss = m->forward(b, *w, true, den);
    m->backward(*w);
    s->synchronize();
    for (const auto& u : w->units())
      for (const auto& p : u.params) r.grads.push_back(w->grad(p.name));
    return r;
  }
};

// max |a - ref| / max |ref| over one tensor.
double rel(const std::vector<float>& a, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    num = std::max(num, std::fabs(double(a[i]) - ref[i]));
    den = std::max(den, std::fabs(double(ref[i])));
  }
  return num / std::max(den, 1e-30);
}

// A document: tokens, and targets whose first `prompt` are masked (an SFT prompt).
struct Doc {
  std::vector<std::int32_t> tokens, targets;
};
Doc make_doc(std::int64_t len, std::int64_t prompt, std::int64_t vocab, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  Doc d;
  for (std::int64_t i = 0; i < len; ++i) {
    d.tokens.push_back(std::int32_t(rng() % std::uint64_t(vocab)));
    d.targets.push_back(i < prompt ? kIgnoreTarget : std::int32_t(rng() % std::uint64_t(vocab)));
  }
  return d;
}

struct PackCase {
  std::string name;
  const char* json;
  DType dtype;
  double tol;
};
void PrintTo(const PackCase& c, std::ostream* os) { *os << c.name; }

class Packing : public ::testing::TestWithParam<PackCase> {};

TEST_P(Packing, PackedRowEqualsItsDocumentsAsSeparateRows) {
  const PackCase& c = GetParam();
  const ModelConfig cfg = parse_model_config(c.json, "cfg");
  // Row 0 packs three documents (5, 7 and 4 tokens), row 1 is one whole document of 16.
  const std::vector<Doc> docs = {
      make_doc(5, 2, cfg.vocab_size, 1), make_doc(7, 3, cfg.vocab_size, 2),
      make_doc(4, 1, cfg.vocab_size, 3), make_doc(kT, 6, cfg.vocab_size, 4)};
  Batch packed;
  for (const Doc& d : docs) {
    packed.tokens.insert(packed.tokens.end(), d.tokens.begin(), d.tokens.end());
    packed.targets.insert(packed.targets.end(), d.targets.begin(), d.targets.end());
    for (std::size_t i = 0; i < d.tokens.size(); ++i) packed.positions.push_back(std::int32_t(i));
  }
  ASSERT_EQ(packed.tokens.size(), std::size_t(2 * kT));
  // Each document a row of its own, padded with other tokens whose targets do not count.
  Batch separate;
  for (const Doc& d : docs) {
    separate.tokens.insert(separate.tokens.end(), d.tokens.begin(), d.tokens.end());
    separate.targets.insert(separate.targets.end(), d.targets.begin(), d.targets.end());
    for (std::size_t i = d.tokens.size(); i < std::size_t(kT); ++i) {
      separate.tokens.push_back(std::int32_t((i * 13) % std::size_t(cfg.vocab_size)));
      separate.targets.push_back(kIgnoreTarget);
    }
  }
  ASSERT_EQ(counted_targets(packed), counted_targets(separate));

  Fixture fp(c.json, 2, c.dtype), fs(c.json, 4, c.dtype);
  const Result a = fp.step(packed), b = fs.step(separate);
  EXPECT_NEAR(a.loss, b.loss, c.tol * b.loss);
  ASSERT_EQ(a.grads.size(), b.grads.size());
  double worst = 0;
  for (std::size_t i = 0; i < a.grads.size(); ++i) {
    const double e = rel(a.grads[i], b.grads[i]);
    worst = std::max(worst, e);
    EXPECT_LT(e, c.tol) << "gradient " << i;
  }
  std::printf("[ packing  ] %s: loss %.7f vs %.7f separate, worst gradient error %.2e\n",
              c.name.c_str(), a.loss, b.loss, worst);

  // The same rows unpacked (one document of 16 per row) attend across the documents: another loss,
  // so the positions are read.
  Batch unpacked = packed;
  unpacked.positions.clear();
  EXPECT_GT(std::fabs(fp.step(unpacked).loss - a.loss), 1e-3 * a.loss);

  // Activation checkpointing recomputes the packed layers exactly.
  Fixture fc(c.json, 2, c.dtype, /*ckpt=*/true);
  const Result r = fc.step(packed);
  EXPECT_EQ(r.loss, a.loss);
  for (std::size_t i = 0; i < a.grads.size(); ++i)
    EXPECT_TRUE(r.grads[i] == a.grads[i]) << "checkpointed, gradient " << i;
}

INSTANTIATE_TEST_SUITE_P(Families, Packing,
                         ::testing::Values(PackCase{"llama_gqa", kLlamaGqa, DType::kF32, 5e-6},
                                           PackCase{"gpt2", kGpt2, DType::kF32, 5e-6},
                                           PackCase{"llama_gqa_bf16", kLlamaGqa, DType::kBF16,
                                                    1e-2},
                                           PackCase{"gpt2_bf16", kGpt2, DType::kBF16, 1e-3}),
                         [](const ::testing::TestParamInfo<PackCase>& i) { return i.param.name; });

class Masking : public ::testing::TestWithParam<const char*> {};

TEST_P(Masking, MaskedTargetsAddNothing) {
  Fixture f(GetParam(), 2);
  const std::int64_t V = f.cfg.vocab_size;
  std::mt19937_64 rng(21);
  Batch data;  // the data before masking: every target a token
  for (std::int64_t i = 0; i < 2 * kT; ++i) {
    data.tokens.push_back(std::int32_t(rng() % std::uint64_t(V)));
    data.targets.push_back(std::int32_t(rng() % std::uint64_t(V)));
  }
  // Prompts: the first 6 tokens of row 0 and the first 9 of row 1.
  auto masked = [](Batch b) {
    for (std::int64_t t = 0; t < 6; ++t) b.targets[std::size_t(t)] = kIgnoreTarget;
    for (std::int64_t t = 0; t < 9; ++t) b.targets[std::size_t(kT + t)] = kIgnoreTarget;
    return b;
  };
  const Batch sft = masked(data);
  EXPECT_EQ(counted_targets(sft), 2 * kT - 15);
  const Result a = f.step(sft);

  // The loss is the mean over the counted targets of -log softmax(logits)[target].
  const std::vector<float> logits = f.m->logits(sft.tokens, *f.w);
  double sum = 0;
  for (std::int64_t r = 0; r < 2 * kT; ++r) {
    if (sft.targets[std::size_t(r)] == kIgnoreTarget) continue;
    const float* l = logits.data() + r * V;
    double mx = l[0], z = 0;
    for (std::int64_t i = 1; i < V; ++i) mx = std::max(mx, double(l[i]));
    for (std::int64_t i = 0; i < V; ++i) z += std::exp(double(l[i]) - mx);
    sum += mx + std::log(z) - l[sft.targets[std::size_t(r)]];
  }
  const double mean = sum / double(counted_targets(sft));
  EXPECT_NEAR(a.loss, mean, 1e-5 * mean);

  // Other ids at the masked positions of the data, masked again: not a bit changes.
  Batch other = data;
  for (std::size_t i = 0; i < other.targets.size(); ++i)
    if (sft.targets[i] == kIgnoreTarget)
      other.targets[i] = std::int32_t((other.targets[i] + 17) % V);
  const Result b = f.step(masked(other));
  EXPECT_EQ(a.loss, b.loss);
  for (std::size_t i = 0; i < a.grads.size(); ++i)
    EXPECT_TRUE(a.grads[i] == b.grads[i]) << "gradient " << i;

  // Without the mask the prompt's targets count: another loss.
  const Result u = f.step(data);
  EXPECT_GT(std::fabs(u.loss - a.loss), 1e-3 * a.loss);

  // A denominator twice the counted targets halves the loss and every gradient, exactly.
  const Result h = f.step(sft, 2.0 * double(counted_targets(sft)));
  EXPECT_EQ(h.loss, a.loss / 2);
  for (std::size_t i = 0; i < a.grads.size(); ++i) {
    std::vector<float> half = a.grads[i];
    for (float& g : half) g /= 2;
    EXPECT_TRUE(h.grads[i] == half) << "gradient " << i;
  }
}

TEST_P(Masking, EveryTargetMaskedIsAnErrorUnlessTheStepGivesTheDenominator) {
  Fixture f(GetParam(), 1);
  Batch b;
  for (std::int64_t i = 0; i < kT; ++i) {
    b.tokens.push_back(std::int32_t(i % 7));
    b.targets.push_back(kIgnoreTarget);
  }
  EXPECT_EQ(counted_targets(b), 0);
  try {
    f.m->forward(b, *f.w);
    ADD_FAILURE() << "an all-masked batch trained";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("every target of the batch is kIgnoreTarget"), std::string::npos)
        << e.message();
  }
  // One micro-batch of a step whose other micro-batches count: nothing added, loss 0.
  const Result r = f.step(b, 10.0);
  EXPECT_EQ(r.loss, 0.0f);
  for (const auto& g : r.grads)
    for (float v : g) ASSERT_EQ(v, 0.0f);
}

INSTANTIATE_TEST_SUITE_P(Families, Masking, ::testing::Values(kLlamaGqa, kGpt2),
                         [](const auto& i) { return i.index == 0 ? "llama" : "gpt2"; });

void expect_error(Model& m, UnitProvider& w, const Batch& b, const std::string& what) {
  try {
    m.forward(b, w);
    ADD_FAILURE() << "no error; expected one with: " << what;
  } catch (const Error& e) {
    EXPECT_NE(e.message().find(what), std::string::npos) << e.message();
  }
}

TEST(Packing, BadPositionsAndTargetsNameTheProblem) {
  Fixture f(kLlamaGqa, 2);
  Batch good;
  for (std::int64_t i = 0; i < 2 * kT; ++i) {
    good.tokens.push_back(std::int32_t(i % 11));
    good.targets.push_back(std::int32_t(i % 13));
    good.positions.push_back(std::int32_t(i % kT));
  }
  EXPECT_NO_THROW(f.m->forward(good, *f.w, false));
  Batch b = good;
  b.positions.pop_back();
  expect_error(*f.m, *f.w, b, "batch.positions has 31 entries");
  b = good;
  b.positions[std::size_t(kT)] = 3;  // row 1 does not start a document
  expect_error(*f.m, *f.w, b, "batch.positions[16] = 3: row 1 must start a document");
  b = good;
  b.positions[5] = 6;  // a jump
  expect_error(*f.m, *f.w, b, "batch.positions[5] = 6 after 4");
  b = good;
  b.positions[7] = -1;
  expect_error(*f.m, *f.w, b, "batch.positions[7] = -1 after 6");
  b = good;
  b.targets[3] = -5;  // only -100 is the ignore index
  expect_error(*f.m, *f.w, b, "batch.targets[3] = -5 is outside the vocabulary");
  b = good;
  b.tokens[2] = kIgnoreTarget;  // never in the inputs
  expect_error(*f.m, *f.w, b, "batch.tokens[2] = -100 is outside the vocabulary");
  try {
    f.m->forward(good, *f.w, false, -1.0);
    ADD_FAILURE() << "a negative denominator was taken";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("loss_denominator -1 must be > 0"), std::string::npos)
        << e.message();
  }
}

}  // namespace
}  // namespace strata
