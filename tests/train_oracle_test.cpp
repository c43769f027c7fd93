// A model trained and saved by strata::train (--out) loads in the PyTorch reference
// (tests/oracle/model_ref.py, which reads a folder as Hugging Face's from_pretrained does and
// shares no code with strata) from the folder alone, and its logits match ours from the same
// folder (load_hf_weights + Model::logits).
//
// Cases: a Llama with grouped-query attention and an untied head, and a GPT-2 (tied head: no
// lm_head.weight in the files), each saved in fp32 and in bf16, in one model.safetensors or cut
// into shards (TrainOptions::out_max_shard_bytes, strata-train --max-shard-mb) with
// model.safetensors.index.json. The batch and the reference's output live outside the folder
// (model_ref.py --batch, --out), and the folder is checked unchanged after the reference read it.
//
// Both sides read the saved values exactly (bf16 widened to fp32 here, to float64 there), so the
// fp32-compute comparison holds at the fp32 tolerance of model_oracle_test (2e-5, max |error| /
// max |reference|); a bf16 save is also compared in bf16 compute against model_ref.py
// --bf16-gemm at that test's bf16 tolerance (1e-2). The folder's config.json must say what
// Hugging Face needs to pick the class and dtype: model_type, architectures, torch_dtype.
// Skipped, never passed, when /usr/bin/python3 cannot import torch.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>

#include "strata/model.h"
#include "strata/model_io.h"
#include "strata/trainer.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

struct SavedCase {
  std::string name;
  std::string config;
  std::string dtype;  // the run's --dtype: what --out saves
  std::size_t max_shard_bytes;
  std::string architecture;
  bool tied;
};

void PrintTo(const SavedCase& c, std::ostream* os) { *os << c.name; }

bool have_torch() {
  static const bool ok = std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") == 0;
  return ok;
}

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Every file of `dir` (recursively) with its bytes.
std::map<std::string, std::string> contents(const fs::path& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) out[fs::relative(e.path(), dir).string()] = slurp(e.path());
  return out;
}

double rel_err(const std::vector<float>& a, const std::vector<float>& ref) {
  EXPECT_EQ(a.size(), ref.size());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < std::min(a.size(), ref.size()); ++i) {
    num = std::max(num, std::fabs(double(a[i]) - ref[i]));
    den = std::max(den, std::fabs(double(ref[i])));
  }
  return num / std::max(den, 1e-30);
}

class TrainedModelOracle : public ::testing::TestWithParam<SavedCase> {};

TEST_P(TrainedModelOracle, TheOutFolderAloneLoadsInTheReferenceAndItsLogitsMatchOurs) {
  if (!have_torch())
    GTEST_SKIP() << "/usr/bin/python3 cannot import torch (apt-get install python3-torch)";
  const SavedCase& c = GetParam();
  const fs::path root =
      fs::temp_directory_path() / fmt::format("strata_train_oracle_{}_{}", c.name, ::getpid());
  fs::remove_all(root);
  fs::create_directories(root);
  const fs::path cfg_file = root / "config.json", data = root / "train.u16", out = root / "out";
  std::ofstream(cfg_file) << c.config;
  const ModelConfig cfg = load_model_config(cfg_file.string());
  {
    std::mt19937_64 rng(7);
    std::vector<std::uint16_t> ids(3000);
    for (auto& id : ids) id = static_cast<std::uint16_t>(rng() % std::uint64_t(cfg.vocab_size));
    std::ofstream(data, std::ios::binary)
        .write(reinterpret_cast<const char*>(ids.data()), std::streamsize(ids.size() * 2));
  }

  TrainOptions o;
  o.model_config = cfg_file.string();
  o.data_files = {data.string()};
  o.data_format = "u16";
  o.seq_len = 8;
  o.micro_batch = 2;
  o.steps = 3;
  o.lr = 1e-2;  // far enough from the initialisation that a wrong tensor shows
  o.dtype = c.dtype;
  o.device = "cpu";
  o.out_dir = out.string();
  o.out_max_shard_bytes = c.max_shard_bytes;
  std::FILE* quiet = std::fopen("/dev/null", "w");
  ASSERT_NE(quiet, nullptr);
  o.console = quiet;
  train(o);
  std::fclose(quiet);

  // What Hugging Face reads to pick the class and the dtype, and the weights' files, nothing else.
  const nlohmann::json saved = nlohmann::json::parse(slurp(out / "config.json"));
  EXPECT_EQ(saved.value("model_type", ""), cfg.model_type);
  EXPECT_EQ(saved.value("architectures", nlohmann::json()), nlohmann::json({c.architecture}));
  EXPECT_EQ(saved.value("torch_dtype", ""), c.dtype == "bf16" ? "bfloat16" : "float32");
  const bool sharded = fs::exists(out / "model.safetensors.index.json");
  EXPECT_EQ(sharded, c.max_shard_bytes < (std::size_t(1) << 20)) << "the case's shard size";
  EXPECT_NE(sharded, fs::exists(out / "model.safetensors"));
  std::set<std::string> files, names;
  for (const auto& e : fs::directory_iterator(out)) files.insert(e.path().filename().string());
  if (sharded) {
    const nlohmann::json index = nlohmann::json::parse(slurp(out / "model.safetensors.index.json"));
    std::set<std::string> want = {"config.json", "model.safetensors.index.json"};
    for (const auto& [name, file] : index.at("weight_map").items()) {
      want.insert(file.get<std::string>());
      names.insert(name);
    }
    EXPECT_GE(want.size(), 4u) << "at least two shards";
    EXPECT_EQ(files, want);
  } else {
    EXPECT_EQ(files, (std::set<std::string>{"config.json", "model.safetensors"}));
    SafetensorsFile st((out / "model.safetensors").string());
    for (const auto& t : st.tensors()) names.insert(t.name);
  }
  const bool has_head = names.count("lm_head.weight") > 0;
  EXPECT_EQ(has_head, !c.tied) << "a tied head is the embedding, not a tensor of its own";
  const auto before = contents(out);

  // The batch and the reference's output beside the folder, not in it.
  const std::int64_t B = 2, T = 8;
  std::mt19937_64 rng(5);
  Batch b;
  for (std::int64_t i = 0; i < B * T; ++i) {
    b.tokens.push_back(static_cast<std::int32_t>(rng() % std::uint64_t(cfg.vocab_size)));
    b.targets.push_back(static_cast<std::int32_t>(rng() % std::uint64_t(cfg.vocab_size)));
  }
  std::vector<float> tf(b.tokens.begin(), b.tokens.end()), gf(b.targets.begin(), b.targets.end());
  const fs::path batch_file = root / "batch.safetensors";
  write_safetensors(batch_file.string(), {{"tokens", DType::kF32, {B, T}, tf.data()},
                                          {"targets", DType::kF32, {B, T}, gf.data()}});

  std::vector<DType> computes = {DType::kF32};
  if (c.dtype == "bf16") computes.push_back(DType::kBF16);
  for (const DType compute : computes) {
    const bool bf16 = compute == DType::kBF16;
    const fs::path ref_file = root / fmt::format("ref_{}.safetensors", dtype_name(compute));
    const std::string cmd = fmt::format(
        "/usr/bin/python3 {}/tests/oracle/model_ref.py {}--batch {} --out {} {}", STRATA_SOURCE_DIR,
        bf16 ? "--bf16-gemm " : "", batch_file.string(), ref_file.string(), out.string());
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    SafetensorsFile ref(ref_file.string());

    auto dev = make_host_device();
    auto s = dev->create_stream("model");
    ModelOptions mo;
    mo.micro_batch = B;
    mo.seq_len = T;
    mo.compute = compute;
    const ModelConfig loaded = load_model_config((out / "config.json").string());
    Model m(loaded, *dev, *s, mo);
    ResidentWeights w(m, *s);
    load_hf_weights(out.string(), w);
    const double e = rel_err(m.logits(b.tokens, w), ref.read_f32("logits"));
    EXPECT_LT(e, bf16 ? 1e-2 : 2e-5) << dtype_name(compute) << " compute";
    std::printf("[ oracle   ] %s, %s compute: logits error %.2e\n", c.name.c_str(),
                std::string(dtype_name(compute)).c_str(), e);
  }
  EXPECT_EQ(contents(out), before) << "the reference only reads the folder";
  fs::remove_all(root);
}

const char* kLlamaGqa =
    R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 131,
  "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 2, "num_attention_heads": 6,
  "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
  "tie_word_embeddings": false})";
const char* kGpt2 =
    R"({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 113,
  "n_embd": 36, "n_layer": 2, "n_head": 3, "n_positions": 16, "layer_norm_epsilon": 1e-5,
  "activation_function": "gelu_new"})";

constexpr std::size_t kWhole = std::size_t(5) << 30, kSmall = std::size_t(24) << 10;

INSTANTIATE_TEST_SUITE_P(
    Saved, TrainedModelOracle,
    ::testing::Values(
        SavedCase{"llama_gqa_fp32", kLlamaGqa, "fp32", kWhole, "LlamaForCausalLM", false},
        SavedCase{"llama_gqa_bf16_sharded", kLlamaGqa, "bf16", kSmall, "LlamaForCausalLM", false},
        SavedCase{"gpt2_fp32_sharded", kGpt2, "fp32", kSmall, "GPT2LMHeadModel", true},
        SavedCase{"gpt2_bf16", kGpt2, "bf16", kWhole, "GPT2LMHeadModel", true}),
    [](const ::testing::TestParamInfo<SavedCase>& i) { return i.param.name; });

}  // namespace
}  // namespace strata
