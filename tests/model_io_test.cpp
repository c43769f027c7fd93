// Weights I/O (config.json + safetensors, single and sharded) and token data loaders.
#include "strata/model_io.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <algorithm>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <set>

#include "strata/error.h"
#include "strata/model.h"
#include "strata/model_data.h"
#include "test_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

const char* kLlama =
    R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 67,
  "hidden_size": 32, "intermediate_size": 40, "num_hidden_layers": 2, "num_attention_heads": 4,
  "num_key_value_heads": 2, "max_position_embeddings": 32})";
const char* kGpt2 =
    R"({"model_type": "gpt2", "vocab_size": 71, "n_embd": 24, "n_layer": 2, "n_head": 2,
  "n_positions": 16})";

fs::path scratch(const std::string& name) {
  const fs::path p =
      fs::temp_directory_path() / fmt::format("strata_model_io_{}_{}", name, ::getpid());
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

using testing::expect_error;
using testing::slurp;

struct Env {
  std::unique_ptr<Device> dev = make_host_device();
  std::unique_ptr<Stream> s = dev->create_stream("io");
};

void expect_same_bytes(const ResidentWeights& a, const ResidentWeights& b) {
  for (const auto& u : a.units())
    for (const auto& p : u.params) EXPECT_EQ(a.get_bytes(p.name), b.get_bytes(p.name)) << p.name;
}

class RoundTrip : public ::testing::TestWithParam<std::tuple<const char*, DType, std::size_t>> {};

TEST_P(RoundTrip, SaveThenLoadIsBitExact) {
  const auto [json, dt, shard] = GetParam();
  Env e;
  const ModelConfig cfg = parse_model_config(json, "cfg");
  ResidentWeights a(cfg, dt, *e.dev, *e.s);
  a.init_random(7, 0.5f);
  const fs::path dir = scratch("rt");
  // Over a save of the other layout: nothing of it may be left for a loader to take first.
  save_hf_weights(dir.string(), a,
                  shard < (std::size_t(1) << 30) ? std::size_t(1) << 40 : std::size_t(20000));
  save_hf_weights(dir.string(), a, shard);
  const bool sharded = shard < (std::size_t(1) << 30);
  EXPECT_EQ(fs::exists(dir / "model.safetensors.index.json"), sharded);
  EXPECT_EQ(fs::exists(dir / "model.safetensors"), !sharded);
  int shards = 0;
  for (const auto& f : fs::directory_iterator(dir))
    shards += f.path().filename().string().starts_with("model-");
  EXPECT_EQ(shards > 1, sharded) << shards << " shard files";
  for (const auto& f : fs::directory_iterator(dir))
    EXPECT_FALSE(f.path().filename().string().starts_with(".strata-tmp")) << f.path();
  const ModelConfig back = load_model_config((dir / "config.json").string());
  EXPECT_EQ(back.model_type, cfg.model_type);
  EXPECT_EQ(back.num_kv_heads, cfg.num_kv_heads);
  ResidentWeights b(back, dt, *e.dev, *e.s);
  load_hf_weights(dir.string(), b);
  expect_same_bytes(a, b);
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, RoundTrip,
    ::testing::Values(std::make_tuple(kLlama, DType::kF32, std::size_t(1) << 40),
                      std::make_tuple(kLlama, DType::kBF16, std::size_t(1) << 40),
                      std::make_tuple(kLlama, DType::kF32, std::size_t(20000)),
                      std::make_tuple(kGpt2, DType::kBF16, std::size_t(9000))));

TEST(ModelIo, Fp32FileLoadsIntoBf16RoundedToNearestEven) {
  Env e;
  const ModelConfig cfg = parse_model_config(kGpt2, "cfg");
  ResidentWeights a(cfg, DType::kF32, *e.dev, *e.s);
  a.init_random(8, 0.5f);
  const fs::path dir = scratch("conv");
  save_hf_weights(dir.string(), a);
  ResidentWeights b(cfg, DType::kBF16, *e.dev, *e.s);
  load_hf_weights(dir.string(), b);
  const auto src = a.get("transformer.h.1.mlp.c_fc.weight");
  const auto got = b.get_bytes("transformer.h.1.mlp.c_fc.weight");
  for (std::size_t i = 0; i < src.size(); ++i) {
    std::uint16_t h;
    std::memcpy(&h, got.data() + 2 * i, 2);
    ASSERT_EQ(h, f32_to_bf16(src[i])) << i;
  }
  fs::remove_all(dir);
}

// Weights that are not finite are named where they are read (the tensor, the element, the file):
// a run from them failed three steps in, blaming the learning rate.
TEST(ModelIo, AWeightThatIsNotFiniteIsNamedWhenRead) {
  Env e;
  const ModelConfig cfg = parse_model_config(kLlama, "cfg");
  const std::string name = "model.layers.0.mlp.up_proj.weight";
  for (const float bad : {NAN, -INFINITY}) {
    ResidentWeights a(cfg, DType::kF32, *e.dev, *e.s);
    a.init_random(8, 0.5f);
    std::vector<float> v = a.get(name);
    v.at(37) = bad;
    a.set(name, v);
    const fs::path dir = scratch("nan");
    save_hf_weights(dir.string(), a);
    const HfWeightsReader reader(dir.string(), cfg);
    const UnitSpec* unit = nullptr;
    const ParamSpec* p = nullptr;
    for (const UnitSpec& u : a.units())
      for (const ParamSpec& q : u.params)
        if (q.name == name) unit = &u, p = &q;
    ASSERT_NE(p, nullptr);
    std::vector<float> out(p->numel);
    reader.read(*p, 0, 30, out.data());  // the elements before it read
    expect_error([&] { reader.read(*p, 30, 20, out.data()); },
                 {fmt::format("model.safetensors: tensor '{}' holds {} (element 37): the model's "
                              "weights are not finite",
                              name, std::isnan(bad) ? "NaN" : "-Inf"),
                  "use a good copy of the model"});
    // ... and another tensor of the folder is read.
    for (const ParamSpec& q : unit->params)
      if (q.name != name) reader.read(q, 0, q.numel, out.data());
    fs::remove_all(dir);
  }
}

// A folder as others leave it: model.safetensors beside an older sharded save's index is loaded,
// as transformers loads it (the index was taken, and its missing shards refused); PyTorch's
// pickle weights alone are named as such, with the way to safetensors.
TEST(ModelIo, FoldersAsOthersLeaveThemLoadAsTransformersDoes) {
  Env e;
  const ModelConfig cfg = parse_model_config(kGpt2, "cfg");
  ResidentWeights a(cfg, DType::kF32, *e.dev, *e.s);
  a.init_random(8, 0.5f);
  const fs::path dir = scratch("others");
  save_hf_weights(dir.string(), a);
  std::ofstream(dir / "model.safetensors.index.json")
      << R"({"weight_map": {"transformer.wte.weight": "model-00001-of-00002.safetensors"}})";
  ResidentWeights b(cfg, DType::kF32, *e.dev, *e.s);
  load_hf_weights(dir.string(), b);
  EXPECT_EQ(b.get("transformer.wte.weight"), a.get("transformer.wte.weight"));
  fs::remove(dir / "model.safetensors");
  fs::remove(dir / "model.safetensors.index.json");
  std::ofstream(dir / "pytorch_model.bin") << "a pickle";
  expect_error([&] { load_hf_weights(dir.string(), b); },
               {"the weights are in pytorch_model.bin (PyTorch's pickle format), which strata "
                "does not read: save them as safetensors"});
  fs::remove_all(dir);
}

// Every parameter of `w` (fp32) under `rename(its name)`, then `extra`, as dir/model.safetensors.
void write_params(const ResidentWeights& w, const fs::path& dir,
                  const std::vector<SafetensorsTensor>& extra,
                  const std::function<std::string(const std::string&)>& rename) {
  std::vector<std::vector<std::uint8_t>> keep;
  std::vector<SafetensorsTensor> ts;
  for (const auto& u : w.units())
    for (const auto& p : u.params) {
      keep.push_back(w.get_bytes(p.name));
      ts.push_back({rename(p.name), DType::kF32, p.shape, keep.back().data()});
    }
  ts.insert(ts.end(), extra.begin(), extra.end());
  write_safetensors((dir / "model.safetensors").string(), ts);
}

std::string same_name(const std::string& n) { return n; }

TEST(ModelIo, HubGpt2NamesWithoutPrefixLoad) {
  Env e;
  const ModelConfig cfg = parse_model_config(kGpt2, "cfg");
  ResidentWeights a(cfg, DType::kF32, *e.dev, *e.s);
  a.init_random(9, 0.5f);
  const fs::path dir = scratch("hub");
  write_params(a, dir, {},
               [](const std::string& n) { return n.substr(12); });  // "transformer." dropped
  ResidentWeights b(cfg, DType::kF32, *e.dev, *e.s);
  load_hf_weights(dir.string(), b);
  expect_same_bytes(a, b);
  fs::remove_all(dir);
}

// Llama's attention_bias: true gives o_proj a bias (Hugging Face's LlamaAttention); it loads.
TEST(ModelIo, LlamaAttentionBiasLoadsOutputProjectionBias) {
  Env e;
  const ModelConfig cfg =
      parse_model_config(std::string(kLlama).insert(1, R"("attention_bias": true, )"), "cfg");
  ResidentWeights a(cfg, DType::kF32, *e.dev, *e.s);
  a.init_random(12, 0.5f);
  const fs::path dir = scratch("obias");
  save_hf_weights(dir.string(), a);
  ResidentWeights b(cfg, DType::kF32, *e.dev, *e.s);
  load_hf_weights(dir.string(), b);
  const std::vector<float> ob = b.get("model.layers.1.self_attn.o_proj.bias");
  EXPECT_EQ(ob, a.get("model.layers.1.self_attn.o_proj.bias"));
  EXPECT_NE(ob, std::vector<float>(ob.size(), 0.0f));
  fs::remove_all(dir);
}

// Tensors the model does not use are named in one warning (a config that does not match the
// weights would otherwise drop them silently); known buffers are not.
TEST(ModelIo, UnusedTensorsAreNamedInOneWarning) {
  Env e;
  const ModelConfig cfg = parse_model_config(kGpt2, "cfg");
  ResidentWeights a(cfg, DType::kF32, *e.dev, *e.s);
  a.init_random(13, 0.5f);
  const fs::path dir = scratch("unused");
  std::vector<float> v(24, 1.0f);
  const std::vector<SafetensorsTensor> buffers = {
      {"transformer.h.0.attn.bias", DType::kF32, {24}, v.data()},
      {"h.1.attn.masked_bias", DType::kF32, {24}, v.data()},
      {"transformer.h.0.attn.rotary_emb.inv_freq", DType::kF32, {24}, v.data()}};
  std::vector<SafetensorsTensor> extra = buffers;
  extra.push_back({"transformer.h.0.attn.c_attn.lora_A", DType::kF32, {24}, v.data()});
  extra.push_back({"score.weight", DType::kF32, {24}, v.data()});
  write_params(a, dir, extra, same_name);
  ResidentWeights b(cfg, DType::kF32, *e.dev, *e.s);
  ::testing::internal::CaptureStderr();
  load_hf_weights(dir.string(), b);
  const std::string warned = ::testing::internal::GetCapturedStderr();
  expect_same_bytes(a, b);
  EXPECT_NE(warned.find("lora_A"), std::string::npos) << warned;
  EXPECT_NE(warned.find("score.weight"), std::string::npos) << warned;
  EXPECT_NE(warned.find("2 tensors"), std::string::npos) << warned;
  EXPECT_EQ(warned.find("masked_bias"), std::string::npos) << warned;
  EXPECT_EQ(warned.find("inv_freq"), std::string::npos) << warned;
  EXPECT_EQ(std::count(warned.begin(), warned.end(), '\n'), 1) << warned;

  write_params(a, dir, buffers, same_name);
  ::testing::internal::CaptureStderr();
  load_hf_weights(dir.string(), b);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  fs::remove_all(dir);
}

// A key a typo away from one strata reads is said (it trained with rope_theta 10000 and no word);
// the keys of real Hugging Face configs strata has no use for are not.
TEST(ModelIo, ConfigKeyATypoAwayIsSaid) {
  const std::string hf_llama = R"({"architectures": ["LlamaForCausalLM"], "attention_bias": false,
    "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu",
    "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128, "max_position_embeddings": 131072,
    "mlp_bias": false, "model_type": "llama", "num_attention_heads": 4, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0,
    "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
    "rope_type": "llama3"}, "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": true, "vocab_size": 256})";
  const std::string hf_qwen2 = R"({"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 64,
    "initializer_range": 0.02, "intermediate_size": 128, "max_position_embeddings": 32768,
    "max_window_layers": 24, "model_type": "qwen2", "num_attention_heads": 4, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
    "tie_word_embeddings": true, "torch_dtype": "bfloat16", "transformers_version": "4.40.1",
    "use_cache": true, "use_sliding_window": false, "vocab_size": 256})";
  const std::string hf_gpt2 =
      R"({"activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"],
    "attn_pdrop": 0.1, "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256,
    "initializer_range": 0.02, "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024, "n_embd": 64,
    "n_head": 4, "n_layer": 2, "n_positions": 1024, "resid_pdrop": 0.1, "summary_activation": null,
    "summary_first_dropout": 0.1, "summary_proj_to_labels": true, "summary_type": "cls_index",
    "summary_use_proj": true, "task_specific_params": {"text-generation": {"do_sample": true, "max_length": 50}},
    "vocab_size": 256})";
  for (const std::string& j : {hf_llama, hf_qwen2, hf_gpt2}) {
    ::testing::internal::CaptureStderr();
    (void)parse_model_config(j, "config.json");
    EXPECT_EQ(::testing::internal::GetCapturedStderr(), "") << j;
  }
  std::string typo = hf_llama;
  typo.replace(typo.find("\"rope_theta\""), 12, "\"rope_thetta\"");
  ::testing::internal::CaptureStderr();
  const ModelConfig c = parse_model_config(typo, "config.json");
  const std::string warned = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(
      warned.find(
          "config.json: key 'rope_thetta' is not one strata reads; did you mean 'rope_theta'? As "
          "written, 'rope_theta' keeps its default"),
      std::string::npos)
      << warned;
  EXPECT_EQ(c.rope_theta, 10000.0);
  typo = hf_gpt2;
  typo.replace(typo.find("\"layer_norm_epsilon\""), 20, "\"layer_norm_epsilom\"");
  ::testing::internal::CaptureStderr();
  (void)parse_model_config(typo, "config.json");
  EXPECT_NE(::testing::internal::GetCapturedStderr().find("did you mean 'layer_norm_epsilon'"),
            std::string::npos);
  // A required key's typo is named where the key is found missing (its did-you-mean came after).
  typo = hf_llama;
  typo.replace(typo.find("\"num_hidden_layers\""), 19, "\"num_hidden_layer\"");
  testing::expect_error([&] { (void)parse_model_config(typo, "config.json"); },
                        {"config.json: required key 'num_hidden_layers' is missing (the file has "
                         "'num_hidden_layer': a typo of it?)"});
}

// Sizes beyond any model are refused with the key and the limit, before a layout is built from
// them: 2^62 intermediate elements overflowed to a plan of a few thousand parameters that
// "fit", 10^11 layers were laid out until memory ran out, and 2^64 - 1 was read as -1.
TEST(ModelIo, SizesBeyondAnyModelAreRefused) {
  // kLlama with `fields` ("key": value, ...) in place of its own.
  const auto error_of = [](const std::string& fields) {
    nlohmann::json j = nlohmann::json::parse(kLlama);
    j.update(nlohmann::json::parse("{" + fields + "}"));
    try {
      (void)parse_model_config(j.dump(), "cfg");
    } catch (const Error& e) {
      return e.message();
    }
    return std::string("accepted");
  };
  EXPECT_NE(error_of(R"("intermediate_size": 4611686018427387904)")
                .find("cfg: 'intermediate_size' = 4611686018427387904 is beyond what strata runs "
                      "(at most 16777216)"),
            std::string::npos);
  EXPECT_NE(error_of(R"("vocab_size": 288230376151711744)").find("(at most 2147483647)"),
            std::string::npos);
  EXPECT_NE(error_of(R"("num_hidden_layers": 100000000000)").find("(at most 65536)"),
            std::string::npos);
  EXPECT_NE(error_of(R"("intermediate_size": 18446744073709551615)")
                .find("'intermediate_size' = 18446744073709551615 is too large"),
            std::string::npos);
  EXPECT_EQ(error_of(R"("num_hidden_layers": 65536, "intermediate_size": 16777216)"), "accepted");
  // Every dimension within its limit, the whole about 2^61 parameters.
  EXPECT_NE(error_of(R"("hidden_size": 8388608, "intermediate_size": 8388608,
                        "num_attention_heads": 32768, "num_key_value_heads": 32768,
                        "num_hidden_layers": 8192)")
                .find("parameters, beyond what strata runs (at most 2^48"),
            std::string::npos);
}

// Values Hugging Face reads otherwise, or not at all, are refused naming the key (they trained
// to NaN, or silently as another model), and the ones it ignores are ignored.
TEST(ModelIo, ConfigValuesAreReadAsHuggingFaceReadsThem) {
  const auto parsed = [](const char* base, const std::string& fields) {
    nlohmann::json j = nlohmann::json::parse(base);
    j.update(nlohmann::json::parse("{" + fields + "}"));
    return parse_model_config(j.dump(), "cfg");
  };
  const auto error_of = [&](const char* base, const std::string& fields) {
    try {
      (void)parsed(base, fields);
    } catch (const Error& e) {
      return e.message();
    }
    return std::string("accepted");
  };
  const std::vector<std::pair<std::string, std::string>> refused = {
      {R"("rms_norm_eps": -1)", "cfg: 'rms_norm_eps' must be a number >= 0"},
      {R"("rope_theta": 0)", "cfg: 'rope_theta' must be a number > 0"},
      {R"("rope_theta": -10000)", "cfg: 'rope_theta' must be a number > 0"},
      {R"("rope_scaling": {"rope_type": "llama3", "factor": 8.0})",
       "cfg: rope_scaling of type 'llama3' needs 'low_freq_factor'"},
      {R"("rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 0})",
       "original_max_position_embeddings >= 1"},
      {R"("model_type": "mistral", "sliding_window": "16")",
       "cfg: 'sliding_window' must be a whole number of positions >= 1 (or null: none), got "
       "\"16\""},
      {R"("model_type": "mistral", "sliding_window": 16.5)", "'sliding_window' must be a whole"},
      {R"("model_type": "qwen2", "use_sliding_window": "true")",
       "cfg: 'use_sliding_window' must be true or false, got \"true\""},
  };
  for (const auto& [fields, says] : refused)
    EXPECT_NE(error_of(kLlama, fields).find(says), std::string::npos)
        << fields << ": " << error_of(kLlama, fields);
  EXPECT_NE(error_of(kGpt2, R"("tie_word_embeddings": false)")
                .find("cfg: tie_word_embeddings false: strata's GPT-2 ties its output head"),
            std::string::npos);
  EXPECT_NE(error_of(kGpt2, R"("layer_norm_epsilon": -1e-5)")
                .find("'layer_norm_epsilon' must be a number >= 0"),
            std::string::npos);
  // A whole float is the window; Llama's attention has none (Hugging Face's ignores the key).
  EXPECT_EQ(
      binding_sliding_window(parsed(kLlama, R"("model_type": "mistral", "sliding_window": 16.0)")),
      16);
  EXPECT_EQ(
      binding_sliding_window(parsed(kLlama, R"("model_type": "mistral", "sliding_window": null)")),
      0);
  EXPECT_EQ(
      binding_sliding_window(parsed(kLlama, R"("model_type": "llama", "sliding_window": 16)")), 0);
  EXPECT_EQ(
      binding_sliding_window(parsed(kLlama, R"("model_type": "qwen2", "sliding_window": 16)")), 0);
  EXPECT_EQ(
      binding_sliding_window(parsed(
          kLlama, R"("model_type": "qwen2", "sliding_window": 16, "use_sliding_window": true)")),
      16);
  // "dtype" (newer transformers) is read before "torch_dtype", as transformers does.
  EXPECT_EQ(parsed(kLlama, R"("dtype": "bfloat16", "torch_dtype": "float32")").torch_dtype,
            "bfloat16");
  EXPECT_EQ(parsed(kLlama, R"("torch_dtype": "float16")").torch_dtype, "float16");
}

// A saved folder's config says the weights' dtype in both keys transformers reads: a stale "dtype"
// (newer transformers, read first) beside fp32 weights loaded them as bf16.
TEST(ModelIo, ASavedConfigSaysTheWeightsDtypeInEveryKey) {
  Env e;
  nlohmann::json j = nlohmann::json::parse(kLlama);
  j["dtype"] = "bfloat16";
  const ModelConfig cfg = parse_model_config(j.dump(), "cfg");
  ResidentWeights a(cfg, DType::kF32, *e.dev, *e.s);
  a.init_random(8, 0.5f);
  const fs::path dir = scratch("dtype-keys");
  save_hf_weights(dir.string(), a);
  const auto saved = nlohmann::json::parse(testing::slurp((dir / "config.json").string()));
  EXPECT_EQ(saved.value("dtype", ""), "float32");
  EXPECT_EQ(saved.value("torch_dtype", ""), "float32");
  EXPECT_EQ(load_model_config((dir / "config.json").string()).torch_dtype, "float32");
  fs::remove_all(dir);
}

TEST(ModelIo, MalformedFilesNameFileTensorAndOffset) {
  Env e;
  const ModelConfig cfg = parse_model_config(kLlama, "cfg");
  ResidentWeights a(cfg, DType::kF32, *e.dev, *e.s);
  a.init_random(10, 0.5f);
  const fs::path dir = scratch("bad");
  save_hf_weights(dir.string(), a);
  const std::string file = (dir / "model.safetensors").string();
  ResidentWeights b(cfg, DType::kF32, *e.dev, *e.s);

  // A Git LFS pointer in the weights' place (a clone without git-lfs): said, with the fix (it
  // was "truncated safetensors file: the header claims 2336927755350992246 bytes").
  {
    const fs::path lfs = scratch("lfs");
    fs::copy_file(dir / "config.json", lfs / "config.json");
    std::ofstream(lfs / "model.safetensors")
        << "version https://git-lfs.github.com/spec/v1\noid sha256:"
           "4d7a2f0a7b1c3e5f00000000000000000000000000000000000000000000abcd\nsize 5368709120\n";
    expect_error([&] { load_hf_weights(lfs.string(), b); },
                 {(lfs / "model.safetensors").string() + " is a Git LFS pointer",
                  "git lfs install && git lfs pull"});
    fs::remove_all(lfs);
  }

  // A header whose length begins with gzip's bytes (0x088b1f = 559903, padded with spaces as the
  // format allows) is a header, not a gzip file.
  {
    const fs::path padded = scratch("padded");
    fs::copy_file(dir / "config.json", padded / "config.json");
    const std::string bytes = slurp(file);
    std::uint64_t hlen = 0;
    std::memcpy(&hlen, bytes.data(), 8);
    ASSERT_LT(hlen, 559903u);
    std::string header = bytes.substr(8, hlen);
    header.append(559903 - hlen, ' ');
    const std::uint64_t n = header.size();
    std::ofstream f(padded / "model.safetensors", std::ios::binary);
    f.write(reinterpret_cast<const char*>(&n), 8);
    f << header << bytes.substr(8 + hlen);
    f.close();
    ResidentWeights c(cfg, DType::kF32, *e.dev, *e.s);
    load_hf_weights(padded.string(), c);
    expect_same_bytes(a, c);
    fs::remove_all(padded);
  }

  // A tensor missing, of the wrong shape, of the wrong dtype.
  const std::vector<float> one(32 * 32, 1.0f);
  auto rewrite = [&](const std::string& skip, SafetensorsTensor replacement) {
    std::vector<std::vector<std::uint8_t>> keep;
    std::vector<SafetensorsTensor> ts;
    for (const auto& u : a.units())
      for (const auto& p : u.params) {
        if (p.name == skip) {
          if (!replacement.name.empty()) ts.push_back(replacement);
          continue;
        }
        keep.push_back(a.get_bytes(p.name));
        ts.push_back({p.name, DType::kF32, p.shape, keep.back().data()});
      }
    write_safetensors(file, ts);
  };
  rewrite("model.layers.1.mlp.up_proj.weight", {});
  expect_error([&] { load_hf_weights(dir.string(), b); },
               {"model.layers.1.mlp.up_proj.weight", "missing"});
  // An untied head the weights do not have: the config's tie_word_embeddings is named.
  rewrite("lm_head.weight", {});
  expect_error([&] { load_hf_weights(dir.string(), b); },
               {"'lm_head.weight' is missing", "config.json says tie_word_embeddings false"});
  rewrite("model.norm.weight", {"model.norm.weight", DType::kF32, {31}, one.data()});
  expect_error([&] { load_hf_weights(dir.string(), b); },
               {file, "model.norm.weight", "[31]", "[32]"});
  rewrite("model.norm.weight", {"model.norm.weight", DType::kF64, {32}, one.data()});
  expect_error([&] { load_hf_weights(dir.string(), b); }, {"model.norm.weight", "F64"});

  // Truncated: data cut short, then a header length beyond the file.
  rewrite("", {});
  const auto full = fs::file_size(file);
  fs::resize_file(file, full - 10);
  expect_error([&] { load_hf_weights(dir.string(), b); },
               {file, "truncated", std::to_string(full - 10)});
  {
    std::ofstream f(file, std::ios::binary | std::ios::trunc);
    const std::uint64_t hlen = 1000;
    f.write(reinterpret_cast<const char*>(&hlen), 8);
    f << "{}";
  }
  expect_error([&] { load_hf_weights(dir.string(), b); }, {file, "truncated", "1000"});
  {
    std::ofstream f(file, std::ios::binary | std::ios::trunc);
    const std::uint64_t hlen = 5;
    f.write(reinterpret_cast<const char*>(&hlen), 8);
    f << "{oops";
  }
  expect_error([&] { load_hf_weights(dir.string(), b); }, {file, "not valid JSON"});
  // Hostile offsets: an end that wraps round past 2^64 into the header; a shape whose element
  // count overflows.
  const auto hostile = [&](const std::string& header) {
    std::ofstream f(file, std::ios::binary | std::ios::trunc);
    const std::uint64_t hlen = header.size();
    f.write(reinterpret_cast<const char*>(&hlen), 8);
    f << header << std::string(256, '\0');
  };
  hostile(
      R"({"model.norm.weight": {"dtype": "F32", "shape": [64], "data_offsets": [18446744073709551000, 18446744073709551256]}})");
  expect_error([&] { load_hf_weights(dir.string(), b); },
               {file, "model.norm.weight", "truncated or corrupt"});
  hostile(
      R"({"model.norm.weight": {"dtype": "F32", "shape": [4611686018427387904, 4], "data_offsets": [0, 0]}})");
  expect_error([&] { load_hf_weights(dir.string(), b); }, {file, "model.norm.weight", "bad shape"});
  // Bytes past the last tensor (a file written over a longer one) and a hole between tensors: the
  // format has neither, and Hugging Face's loader refuses both (this one loaded them).
  hostile(R"({"model.norm.weight": {"dtype": "F32", "shape": [32], "data_offsets": [0, 128]}})");
  expect_error([&] { load_hf_weights(dir.string(), b); },
               {file, "128 bytes after the last tensor's data"});
  hostile(
      R"({"a": {"dtype": "F32", "shape": [32], "data_offsets": [0, 128]}, "b": {"dtype": "F32", "shape": [16], "data_offsets": [192, 256]}})");
  expect_error([&] { load_hf_weights(dir.string(), b); }, {file, "belong to no tensor"});
  // A tensor named twice: said as that (the last entry won; the first one's bytes belonged to no
  // tensor).
  hostile(
      R"({"a": {"dtype": "F32", "shape": [32], "data_offsets": [0, 128]}, "a": {"dtype": "F32", "shape": [32], "data_offsets": [128, 256]}})");
  expect_error([&] { load_hf_weights(dir.string(), b); },
               {file, "the safetensors header", "the key 'a' is given twice"});
  // A shape nested 100k deep: a segfault when its message dumped it.
  hostile(R"({"a": {"dtype": "F32", "shape": [32, )" + std::string(100000, '[') +
          std::string(100000, ']') + R"(], "data_offsets": [0, 128]}})");
  expect_error([&] { load_hf_weights(dir.string(), b); },
               {file, "the safetensors header", "nested more than 512 deep"});
  // A folder, or a pipe (the open waited for a writer), where the weights belong.
  fs::remove(file);
  fs::create_directory(file);
  expect_error([&] { load_hf_weights(dir.string(), b); }, {file, "is a folder"});
  fs::remove(file);
  ASSERT_EQ(::mkfifo(file.c_str(), 0600), 0);
  expect_error([&] { load_hf_weights(dir.string(), b); }, {file, "not a regular file"});
  fs::remove(file);
  expect_error([&] { load_hf_weights(dir.string(), b); }, {dir.string(), "model.safetensors"});

  // A sharded index naming a shard that does not exist.
  {
    std::ofstream f(dir / "model.safetensors.index.json");
    f << R"({"weight_map": {"model.norm.weight": "model-00009-of-00009.safetensors"}})";
  }
  expect_error([&] { load_hf_weights(dir.string(), b); },
               {"model-00009-of-00009.safetensors", "model.safetensors.index.json names the shard",
                "'model.norm.weight'", "which is not there"});
  // ... or nothing at all (it used to crash).
  std::ofstream(dir / "model.safetensors.index.json") << R"({"weight_map": {}})";
  expect_error([&] { load_hf_weights(dir.string(), b); },
               {"model.safetensors.index.json", "non-empty", "weight_map"});
  // A folder by the index's name (a raw "basic_filebuf::underflow error" named no file).
  fs::remove(dir / "model.safetensors.index.json");
  fs::create_directory(dir / "model.safetensors.index.json");
  expect_error([&] { load_hf_weights(dir.string(), b); },
               {"model.safetensors.index.json is a folder"});
  fs::remove_all(dir);
}

// A sharded folder read as its index says: a tensor a shard holds but the index does not list is
// named with the fix, a shard outside the folder is refused, and a tensor in two shards is said
// (the index's is read; it was taken silently).
TEST(ModelIo, ShardsAreReadAsTheIndexNamesThem) {
  Env e;
  const ModelConfig cfg = parse_model_config(kLlama, "cfg");
  ResidentWeights a(cfg, DType::kF32, *e.dev, *e.s);
  a.init_random(12, 0.5f);
  const fs::path dir = scratch("shards");
  save_hf_weights(dir.string(), a, 16 << 10);
  const fs::path index = dir / "model.safetensors.index.json";
  const std::string original = testing::slurp(index.string());
  const nlohmann::json idx = nlohmann::json::parse(original);
  const std::string norm_shard = idx["weight_map"]["model.norm.weight"];
  ASSERT_NE(norm_shard, idx["weight_map"]["model.embed_tokens.weight"].get<std::string>());
  ResidentWeights b(cfg, DType::kF32, *e.dev, *e.s);
  auto with = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json j = idx;
    edit(j);
    std::ofstream(index) << j.dump();
  };
  with([](nlohmann::json& j) { j["weight_map"].erase("model.norm.weight"); });
  expect_error([&] { load_hf_weights(dir.string(), b); },
               {"tensor 'model.norm.weight' is in " + norm_shard +
                " but not in model.safetensors.index.json's weight_map: add it there"});
  with(
      [](nlohmann::json& j) { j["weight_map"]["model.norm.weight"] = "../elsewhere.safetensors"; });
  expect_error([&] { load_hf_weights(dir.string(), b); },
               {"weight_map['model.norm.weight'] is \"../elsewhere.safetensors\", outside the "
                "model folder"});
  // The embedding's shard also holds a copy of model.norm.weight, of other values.
  std::ofstream(index) << original;
  const std::string embed_shard = idx["weight_map"]["model.embed_tokens.weight"];
  {
    std::vector<std::vector<std::uint8_t>> keep;
    std::vector<SafetensorsTensor> ts;
    for (const auto& [name, shard] : idx["weight_map"].items())
      if (shard == embed_shard) {
        keep.push_back(a.get_bytes(name));
        ts.push_back({name, DType::kF32, a.find(name).second->shape, keep.back().data()});
      }
    const std::vector<float> sevens(32, 7.0f);
    ts.push_back({"model.norm.weight", DType::kF32, {32}, sevens.data()});
    write_safetensors((dir / embed_shard).string(), ts);
  }
  ::testing::internal::CaptureStderr();
  load_hf_weights(dir.string(), b);
  const std::string warned = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(warned.find("1 tensor is in more than one shard: 'model.norm.weight' in "),
            std::string::npos)
      << warned;
  EXPECT_NE(warned.find("(read from " + norm_shard + ")"), std::string::npos) << warned;
  EXPECT_EQ(b.get("model.norm.weight"), a.get("model.norm.weight"));
  fs::remove_all(dir);
}

TEST(ModelIo, FailedSaveWritesNothing) {
  Env e;
  const ModelConfig cfg = parse_model_config(kLlama, "cfg");
  ResidentWeights a(cfg, DType::kF32, *e.dev, *e.s);
  const fs::path dir = scratch("fail");
  fs::create_directories(dir / ".strata-tmp-config.json");  // config.json cannot be written
  EXPECT_THROW(save_hf_weights(dir.string(), a, 20000), Error);
  for (const auto& f : fs::directory_iterator(dir))
    EXPECT_EQ(f.path().filename().string(), ".strata-tmp-config.json")
        << "left behind by a failed save";
  EXPECT_FALSE(fs::exists(dir / "model-00001-of-00004.safetensors"));
  EXPECT_FALSE(fs::exists(dir / "config.json"));
  fs::remove_all(dir);
}

// A small file of a save on a full drive is an error, not an empty file saved: the write was
// buffered, checked before it reached the drive, and the save went on (config.json of 0 bytes).
// /dev/full fails every write with ENOSPC (and is no file to remove).
TEST(ModelIo, ASmallFileTheDriveCannotTakeIsAnError) {
  ASSERT_TRUE(fs::exists("/dev/full"));
  try {
    write_hf_text_file("/dev/full", "{\"model_type\": \"llama\"}\n", "out/config.json");
    ADD_FAILURE() << "no error writing to /dev/full";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kIo);
    EXPECT_NE(std::string(e.what()).find(
                  "cannot write out/config.json: No space left on device: free space there"),
              std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(fs::exists("/dev/full"));
  const fs::path dir = scratch("text");
  fs::create_directories(dir);
  write_hf_text_file((dir / "a.json").string(), "{}\n", "a.json");
  EXPECT_EQ(slurp((dir / "a.json").string()), "{}\n");
  fs::remove_all(dir);
}

// ---- token data ----

template <class T>
fs::path write_tokens(const fs::path& dir, const std::string& name, const std::vector<T>& ids,
                      std::int32_t llmc_version = 0) {
  const fs::path p = dir / name;
  std::ofstream f(p, std::ios::binary);
  if (llmc_version) {
    std::int32_t h[256] = {20240520, llmc_version, static_cast<std::int32_t>(ids.size())};
    f.write(reinterpret_cast<const char*>(h), sizeof h);
  }
  f.write(reinterpret_cast<const char*>(ids.data()), ids.size() * sizeof(T));
  return p;
}

TEST(TokenData, UnshuffledBatchesAreLlmcExact) {
  const fs::path dir = scratch("data");
  std::vector<std::uint16_t> a(100), b(40);
  for (int i = 0; i < 100; ++i) a[i] = static_cast<std::uint16_t>(i);
  for (int i = 0; i < 40; ++i) b[i] = static_cast<std::uint16_t>(1000 + i);
  DataOptions o;
  o.files = {write_tokens(dir, "a.bin", a, 1).string(), write_tokens(dir, "b.bin", b, 1).string()};
  o.batch = 3;
  o.seq_len = 7;  // B*T = 21
  TokenLoader loader(o);
  // a: positions 0, 21, 42, 63 (63 + 22 <= 100; 84 + 22 > 100); b: position 0 only.
  EXPECT_EQ(loader.batches_per_epoch(), 5);
  for (int k = 0; k < 4; ++k) {
    const Batch x = loader.next();
    for (int i = 0; i < 21; ++i) {
      ASSERT_EQ(x.tokens[i], 21 * k + i);
      ASSERT_EQ(x.targets[i], 21 * k + i + 1);
    }
  }
  const Batch y = loader.next();
  EXPECT_EQ(y.tokens[0], 1000);
  EXPECT_EQ(y.targets[20], 1021);
  EXPECT_EQ(loader.epoch(), 1);  // wrapped
  EXPECT_EQ(loader.next().tokens[0], 0);
  // A file too short for one batch beside the others is said, not skipped without a word.
  std::vector<std::uint16_t> c(15, 7);
  o.files.push_back(write_tokens(dir, "c.bin", c, 1).string());
  ::testing::internal::CaptureStderr();
  { TokenLoader with_short(o); }
  const std::string warned = ::testing::internal::GetCapturedStderr();
  // (files read whole: no "train split" of them, which an --eval-data file is not)
  EXPECT_NE(warned.find(o.files.back() +
                        " (15 tokens) holds fewer than --micro-batch x --seq-len + 1 = 22 tokens"),
            std::string::npos)
      << warned;
  // Alone, it is refused, as the files it is.
  DataOptions alone = o;
  alone.files = {o.files.back()};
  try {
    TokenLoader none(alone);
    ADD_FAILURE() << "a file too short for one batch was read";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no file holds --micro-batch x --seq-len + 1 = 22 tokens"),
              std::string::npos)
        << e.what();
  }
  fs::remove_all(dir);
}

// What --epochs counts from: the sequences an epoch gives, from the files' sizes and headers
// alone, the number the loader then walks (its batches, and its windows: every one once).
TEST(TokenData, MeasuredRowsAreTheLoadersEpoch) {
  const fs::path dir = scratch("measure");
  std::vector<std::uint16_t> a(100), b(40);
  for (int i = 0; i < 100; ++i) a[i] = static_cast<std::uint16_t>(i);
  for (int i = 0; i < 40; ++i) b[i] = static_cast<std::uint16_t>(1000 + i);
  DataOptions o;
  o.files = {write_tokens(dir, "a.bin", a, 1).string(), write_tokens(dir, "b.bin", b, 1).string()};
  o.batch = 3;
  o.seq_len = 7;
  DataExtent e = measure_tokens(o);
  EXPECT_EQ(e.tokens, 140);
  EXPECT_EQ(e.rows, 15);  // unshuffled: (99 / 21 = 4) + (39 / 21 = 1) batches of 3 rows
  EXPECT_EQ(e.rows, TokenLoader(o).batches_per_epoch() * o.batch);
  o.shuffle = true;
  e = measure_tokens(o);
  EXPECT_EQ(e.rows, 99 / 7 + 39 / 7);  // windows of 8 tokens at a stride of 7: 14 + 5
  {
    TokenLoader loader(o);
    std::set<std::pair<std::int32_t, std::int32_t>> seen;  // (first token, last target)
    for (std::int64_t k = 0; k < e.rows / o.batch; ++k) {
      const Batch x = loader.next();
      for (std::int64_t r = 0; r < o.batch; ++r)
        seen.insert({x.tokens[r * 7], x.targets[r * 7 + 6]});
    }
    EXPECT_EQ(std::int64_t(seen.size()), e.rows / o.batch * o.batch);  // none twice
    EXPECT_EQ(loader.epoch(), 0);
  }
  o.val_fraction = 0.25;  // a: 75 train tokens, b: 30
  e = measure_tokens(o);
  EXPECT_EQ(e.tokens, 105);
  EXPECT_EQ(e.rows, 74 / 7 + 29 / 7);
  EXPECT_EQ(measure_tokens(o, DataSplit::kVal).tokens, 35);
  o.files.push_back((dir / "missing.bin").string());
  EXPECT_THROW(measure_tokens(o), Error);
  fs::remove_all(dir);
}

TEST(TokenData, U32BytesShuffleAndSplit) {
  const fs::path dir = scratch("data2");
  std::vector<std::uint32_t> ids(200);
  for (int i = 0; i < 200; ++i) ids[i] = 70000u + i;
  DataOptions o;
  o.files = {write_tokens(dir, "t.u32", ids).string()};
  o.format = TokenFormat::kU32;
  o.batch = 2;
  o.seq_len = 9;
  o.shuffle = true;
  o.seed = 42;
  o.val_fraction = 0.25;
  TokenLoader train(o), train2(o), val(o, DataSplit::kVal);
  EXPECT_EQ(train.num_tokens(), 150);
  EXPECT_EQ(val.num_tokens(), 50);
  std::set<std::int32_t> starts;
  for (std::int64_t k = 0; k < train.batches_per_epoch(); ++k) {
    const Batch x = train.next(), x2 = train2.next();
    EXPECT_EQ(x.tokens, x2.tokens);  // seeded: the same order
    for (int r = 0; r < 2; ++r) {
      const std::int32_t s0 = x.tokens[r * 9];
      EXPECT_EQ((s0 - 70000) % 9, 0);
      EXPECT_LT(s0 - 70000 + 10, 151);
      for (int i = 0; i < 9; ++i) EXPECT_EQ(x.targets[r * 9 + i], s0 + i + 1);
      starts.insert(s0);
    }
  }
  EXPECT_EQ(starts.size(), 16u);  // (150 - 1) / 9 windows, each once per epoch
  const Batch v = val.next();
  EXPECT_GE(v.tokens[0], 70150);
  o.shuffle = false;
  o.val_fraction = 0;
  o.seed = 0;
  std::vector<std::int32_t> first;
  {
    TokenLoader plain(o);
    first = plain.next().tokens;
  }
  EXPECT_EQ(first[0], 70000);

  std::ofstream(dir / "hello.txt") << "hello, strata! hello again.";
  DataOptions t;
  t.files = {(dir / "hello.txt").string()};
  t.batch = 1;
  t.seq_len = 5;
  t.vocab_size = 256;
  TokenLoader text(t);
  const Batch h = text.next();
  EXPECT_EQ(h.tokens, (std::vector<std::int32_t>{'h', 'e', 'l', 'l', 'o'}));
  EXPECT_EQ(h.targets[4], ',');
  fs::remove_all(dir);
}

// Raw ids of a vocabulary beyond 65536 (Llama 3, Qwen2) cannot be uint16: auto refuses to
// guess u16 for them instead of reading every id wrong.
TEST(TokenData, AutoRefusesRawU16WhenTheVocabDoesNotFit) {
  const fs::path dir = scratch("data4");
  std::vector<std::uint32_t> ids(64);
  for (int i = 0; i < 64; ++i) ids[i] = 100000u + i;
  DataOptions o;
  o.files = {write_tokens(dir, "l3.bin", ids).string()};
  o.batch = 1;
  o.seq_len = 8;
  o.vocab_size = 128256;
  // Raw ids carry no width: auto refuses them, naming the one this vocabulary needs.
  expect_error([&] { TokenLoader l(o); },
               {"l3.bin: no header", "--data-dtype u16 or u32", "vocab_size 128256 needs u32"});
  o.format = TokenFormat::kU32;
  EXPECT_EQ(TokenLoader(o).next().tokens[0], 100000);
  o.format = TokenFormat::kAuto;
  o.files = {write_tokens(dir, "l3llmc.bin", ids, 2).string()};  // llm.c's header says uint32
  EXPECT_EQ(TokenLoader(o).next().tokens[0], 100000);
  // An llm.c file given as raw ids is refused (its header would be read as tokens).
  for (TokenFormat raw : {TokenFormat::kU16, TokenFormat::kU32}) {
    o.format = raw;
    expect_error([&] { TokenLoader l(o); }, {"l3llmc.bin", "llm.c magic", "auto"});
  }
  // A damaged llm.c header is said as what it is: cut inside the header (it said "not an llm.c
  // token file ... found 20240520", the magic it wanted), a negative token count.
  o.format = TokenFormat::kLlmc;
  const fs::path cut = dir / "cut.bin";
  {
    const std::int32_t h[3] = {20240520, 2, 64};
    std::ofstream f(cut, std::ios::binary);
    f.write(reinterpret_cast<const char*>(h), sizeof h);
    f << std::string(488, '\0');  // 500 bytes of a 1024-byte header
  }
  o.files = {cut.string()};
  expect_error(
      [&] { TokenLoader l(o); },
      {"cut.bin: truncated: an llm.c token file's header is 1024 bytes, the file has 500"});
  {
    std::fstream f(dir / "l3llmc.bin", std::ios::binary | std::ios::in | std::ios::out);
    const std::int32_t minus5 = -5;
    f.seekp(8);
    f.write(reinterpret_cast<const char*>(&minus5), 4);
  }
  o.files = {(dir / "l3llmc.bin").string()};
  expect_error([&] { TokenLoader l(o); },
               {"l3llmc.bin: the llm.c header's token count (offset 8) is -5: damaged"});
  fs::remove_all(dir);
}

// Text where token ids are read (JSON lines, prose) is refused in every raw format, not read
// as ids; text read byte by byte is refused for a vocabulary that is not bytes; real ids pass.
TEST(TokenData, TextIsNotReadAsTokenIdsNorBytesAsAWiderVocabulary) {
  const fs::path dir = scratch("data6");
  {
    std::ofstream f(dir / "chat.jsonl");
    for (int i = 0; i < 100; ++i)
      f << R"({"messages": [{"role": "user", "content": "naïve café ✓ )" << i << R"("}]})"
        << "\n";
    std::ofstream(dir / "notes.md") << "# Notes\n\nSome prose,\ttabs and 日本語 text.\n";
    std::ofstream(dir / "corpus.txt") << "hello, strata! hello again, and again.";
  }
  DataOptions o;
  o.batch = 1;
  o.seq_len = 4;
  o.vocab_size = 50257;
  o.files = {(dir / "chat.jsonl").string()};
  for (TokenFormat f : {TokenFormat::kAuto, TokenFormat::kU16, TokenFormat::kU32}) {
    o.format = f;
    expect_error([&] { TokenLoader l(o); },
                 {"chat.jsonl: this is JSON lines text, not token ids", "tokenizer", "--text"});
  }
  o.format = TokenFormat::kAuto;
  o.files = {(dir / "notes.md").string()};
  expect_error([&] { TokenLoader l(o); }, {"notes.md: this is text, not token ids"});
  // Llama 3's vocabulary: the text is named before the id width.
  o.vocab_size = 128256;
  expect_error([&] { TokenLoader l(o); }, {"notes.md: this is text"});

  o.vocab_size = 32000;
  o.files = {(dir / "corpus.txt").string()};
  for (TokenFormat f : {TokenFormat::kAuto, TokenFormat::kBytes}) {
    o.format = f;
    expect_error([&] { TokenLoader l(o); }, {"corpus.txt", "byte by byte", "32000"});
  }
  o.vocab_size = 256;
  EXPECT_EQ(TokenLoader(o).next().tokens[0], 'h');

  // Token ids, even all in the printable range but one, are not text: auto asks for their width,
  // and reads them once given.
  std::vector<std::uint16_t> ids(300, std::uint16_t(0x4142));
  ids[150] = 7;
  o.files = {write_tokens(dir, "ids.bin", ids).string()};
  o.format = TokenFormat::kAuto;
  o.vocab_size = 32000;
  expect_error([&] { TokenLoader l(o); }, {"ids.bin: no header", "--data-dtype u16 or u32"});
  o.format = TokenFormat::kU16;
  EXPECT_EQ(TokenLoader(o).next().tokens[0], 0x4142);
  fs::remove_all(dir);
}

// A shuffled epoch's order depends only on (seed, epoch): reset() replays epoch 0 exactly,
// and every later epoch too.
TEST(TokenData, ShuffledEpochOrderDependsOnlyOnSeedAndEpoch) {
  const fs::path dir = scratch("data5");
  std::vector<std::uint16_t> ids(200);
  for (int i = 0; i < 200; ++i) ids[i] = static_cast<std::uint16_t>(i);
  DataOptions o;
  o.files = {write_tokens(dir, "s.bin", ids).string()};
  o.format = TokenFormat::kU16;
  o.batch = 2;
  o.seq_len = 9;
  o.shuffle = true;
  o.seed = 3;
  TokenLoader a(o);
  const std::int64_t per_epoch = a.batches_per_epoch();
  ASSERT_EQ(per_epoch, 11);  // (200 - 1) / 9 = 22 windows
  auto three_epochs = [&](TokenLoader& l) {
    std::vector<std::vector<std::int32_t>> out;
    for (std::int64_t k = 0; k < 3 * per_epoch; ++k) out.push_back(l.next().tokens);
    return out;
  };
  const auto first = three_epochs(a);
  EXPECT_EQ(a.epoch(), 2);
  EXPECT_NE(
      std::vector(first.begin(), first.begin() + per_epoch),
      std::vector(first.begin() + per_epoch, first.begin() + 2 * per_epoch));  // epochs differ
  a.reset();
  EXPECT_EQ(a.epoch(), 0);
  EXPECT_EQ(three_epochs(a), first);
  TokenLoader b(o);
  EXPECT_EQ(three_epochs(b), first);
  fs::remove_all(dir);
}

TEST(TokenData, BadDataNamesFileAndOffset) {
  const fs::path dir = scratch("data3");
  std::vector<std::uint16_t> ids(64, 3);
  ids[30] = 500;
  DataOptions o;
  o.files = {write_tokens(dir, "v.bin", ids, 1).string()};
  o.batch = 2;
  o.seq_len = 8;
  o.vocab_size = 256;
  TokenLoader loader(o);
  loader.next();  // tokens 0..16
  expect_error([&] { loader.next(); },
               {"v.bin", "token id 500", "byte offset 1084", "vocab_size 256",
                "tokenize the text with this model's tokenizer"});
  // Raw ids that begin as gzip's magic does: the guess said with the width as the other way out.
  {
    DataOptions raw = o;
    std::vector<std::uint16_t> gz(64, 7);
    gz[0] = 0x8b1f;
    gz[1] = 0x0008;
    raw.files = {write_tokens(dir, "gz.bin", gz).string()};
    raw.vocab_size = 50304;
    expect_error([&] { TokenLoader l(raw); }, {"gz.bin is gzip-compressed",
                                               "if it holds raw token ids instead, give their "
                                               "width with --data-dtype u16 or u32"});
  }
  // uint16 ids read as uint32: the width named as the likely fix.
  {
    DataOptions wide = o;
    wide.files = {write_tokens(dir, "u16.bin", std::vector<std::uint16_t>(64, 7)).string()};
    wide.format = TokenFormat::kU32;
    wide.vocab_size = 32000;
    TokenLoader l(wide);
    expect_error([&] { l.next(); }, {"u16.bin: token id 458759",
                                     "if the file holds uint16 ids, give --data-dtype u16"});
  }
  // A header promising more tokens than the file holds.
  std::vector<std::uint16_t> few(10, 1);
  const fs::path p = write_tokens(dir, "short.bin", few, 1);
  fs::resize_file(p, fs::file_size(p) - 4);
  o.files = {p.string()};
  expect_error([&] { TokenLoader l(o); }, {"short.bin", "truncated", "10 tokens"});
  o.files = {write_tokens(dir, "tiny.bin", few).string()};
  o.format = TokenFormat::kU16;
  expect_error([&] { TokenLoader l(o); },
               {"--micro-batch x --seq-len + 1 = 17", "tiny.bin: 10 tokens", "--seq-len"});
  o.shuffle = true;
  o.val_fraction = 0.1;
  expect_error([&] { TokenLoader l(o, DataSplit::kVal); },
               {"validation split", "10% of each file, with --eval-every", "tiny.bin: 10 tokens"});
  fs::remove_all(dir);
}

// A token file cut short under the loader's mapping (`cp` onto it truncates it): the read of a
// page past its new end is a SIGBUS, which ended a run with "Bus error" alone; the handler names
// the file and the fix before the process ends by the signal as it did.
TEST(TokenData, AFileCutShortUnderTheLoaderIsNamed) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const fs::path dir = scratch("data-cut");
  DataOptions o;
  o.files = {write_tokens(dir, "cut.bin", std::vector<std::uint16_t>(1 << 16, 3), 1).string()};
  o.batch = 2;
  o.seq_len = 8;
  o.vocab_size = 256;
  EXPECT_EXIT(
      {
        TokenLoader loader(o);
        loader.next();
        fs::resize_file(o.files[0], 0);
        for (int i = 0; i < 8; ++i) loader.next();
        std::exit(0);
      },
      // Ended by the bus error: its signal, or a sanitizer's report of it (ASan's handler, which
      // ours hands on to, exits with 1).
      [](int st) {
        return (WIFSIGNALED(st) && WTERMSIG(st) == SIGBUS) ||
               (WIFEXITED(st) && WEXITSTATUS(st) == 1);
      },
      "cut.bin became shorter while it was read .*: the run cannot go on. Put the file back as "
      "it was and --resume");
  fs::remove_all(dir);
}

}  // namespace
}  // namespace strata
