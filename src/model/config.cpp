// config.json -> ModelConfig, and the fetch-unit layout of each architecture.
//
// The layout is the contract between the model, the weight files and the engine: one flat
// buffer per unit, each parameter under its Hugging Face name at a 64-element-aligned offset.
// Within a Llama layer q/k/v (and their biases) are adjacent, as are gate/up, so each pair
// or triple is one fused GEMM; GPT-2's Conv1D c_attn is already fused.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "core/json_config.h"
#include "strata/error.h"
#include "strata/log.h"
#include "strata/model.h"
#include "strata/paths.h"

namespace strata {

namespace fs = std::filesystem;
namespace {

constexpr std::size_t kParamAlign = 64;
// The largest model config.json strata takes (models in use have under 2^20 in a dimension, a few
// hundred layers and 2^41 parameters).
constexpr std::int64_t kMaxWidth = std::int64_t(1) << 24, kMaxLayers = std::int64_t(1) << 16,
                       kMaxParams = std::int64_t(1) << 48;

std::string read_text(const std::string& path) {
  // A folder or a pipe named config.json is said (a pipe would block the read).
  require_input_file("", path);
  std::ifstream f(path, std::ios::binary);
  if (!f)
    detail::throw_errno(__FILE__, __LINE__, "open", errno,
                        fmt::format("cannot read the model config {}: check the path", path));
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::int64_t positive(const config::Section& s, const char* key, const std::string& what,
                      std::int64_t def = -1) {
  if (def < 0 && !s.has(key)) {  // a typo of it named (its did-you-mean came after, unreached)
    const std::string guess = config::near_miss(key, s.keys());
    STRATA_THROW(
        kInvalidArgument, "{}: required key '{}' is missing{}", what, key,
        guess.empty() ? std::string() : fmt::format(" (the file has '{}': a typo of it?)", guess));
  }
  const std::int64_t v = s.get_int(key, def);
  STRATA_REQUIRE(v > 0, "{}: '{}' must be > 0, got {}", what, key, v);
  return v;
}

// A key a typo away from one strata reads ("rope_thetta") is said: the setting meant keeps its
// default and the model is another one. Only said, not refused: a Hugging Face config carries
// many keys strata has no use for, and a new one must not stop a model from loading.
void warn_near_misses(const ModelConfig& c, const std::string& what) {
  static const std::vector<std::string> common = {"model_type", "architectures", "vocab_size",
                                                  "initializer_range"};
  static const std::vector<std::string> llama = {"hidden_size",
                                                 "intermediate_size",
                                                 "num_hidden_layers",
                                                 "num_attention_heads",
                                                 "num_key_value_heads",
                                                 "max_position_embeddings",
                                                 "rms_norm_eps",
                                                 "rope_theta",
                                                 "tie_word_embeddings",
                                                 "attention_bias",
                                                 "mlp_bias",
                                                 "hidden_act",
                                                 "rope_scaling",
                                                 "head_dim"};
  static const std::vector<std::string> gpt2 = {"n_embd",
                                                "n_layer",
                                                "n_head",
                                                "n_positions",
                                                "n_inner",
                                                "layer_norm_epsilon",
                                                "activation_function",
                                                "scale_attn_weights",
                                                "scale_attn_by_inverse_layer_idx",
                                                "tie_word_embeddings"};
  std::vector<std::string> known = common;
  const auto& family = c.arch == ModelArch::kGpt2 ? gpt2 : llama;
  known.insert(known.end(), family.begin(), family.end());
  for (auto it = c.raw.begin(); it != c.raw.end(); ++it) {
    if (std::find(known.begin(), known.end(), it.key()) != known.end()) continue;
    const std::string guess = config::near_miss(it.key(), known);
    if (guess.empty() || c.raw.contains(guess)) continue;
    log::warn(
        "{}: key '{}' is not one strata reads; did you mean '{}'? As written, '{}' keeps its "
        "default",
        what, it.key(), guess, guess);
  }
}

ModelConfig parse_model_config_body(const std::string& json_text, const std::string& what) {
  ModelConfig c;
  c.raw =
      config::parse(json_text, what, /*duplicates_last_wins=*/true);  // as transformers reads it
  STRATA_REQUIRE(c.raw.is_object(), "{}: must be a JSON object, got {}", what, c.raw.type_name());
  const config::Section s(&c.raw, "");
  std::string arch;
  if (const auto* a = s.raw("architectures")) {
    STRATA_REQUIRE(a->is_array() && !a->empty() && (*a)[0].is_string(),
                   "{}: 'architectures' must be a non-empty array of strings", what);
    arch = (*a)[0].get<std::string>();
  }
  std::string type = s.get_string("model_type", "");
  if (type.empty()) {
    if (arch == "LlamaForCausalLM")
      type = "llama";
    else if (arch == "MistralForCausalLM")
      type = "mistral";
    else if (arch == "Qwen2ForCausalLM")
      type = "qwen2";
    else if (arch == "GPT2LMHeadModel")
      type = "gpt2";
  }
  STRATA_REQUIRE(type == "llama" || type == "mistral" || type == "qwen2" || type == "gpt2",
                 "{}: model_type '{}' (architectures '{}') is not supported; strata runs llama, "
                 "mistral, qwen2 and gpt2",
                 what, type, arch);
  c.model_type = type;
  if (type == "gpt2") {
    c.arch = ModelArch::kGpt2;
    c.vocab_size = positive(s, "vocab_size", what);
    c.hidden_size = positive(s, "n_embd", what);
    c.num_layers = positive(s, "n_layer", what);
    c.num_heads = positive(s, "n_head", what);
    c.num_kv_heads = c.num_heads;
    c.max_positions = positive(s, "n_positions", what);
    // (the default, 4 x n_embd, of an n_embd no larger than a width: no overflow before the check)
    c.intermediate_size = positive(s, "n_inner", what, 4 * std::min(c.hidden_size, kMaxWidth + 1));
    c.norm_eps = s.get_double("layer_norm_epsilon", 1e-5);
    const std::string act = s.get_string("activation_function", "gelu_new");
    STRATA_REQUIRE(act == "gelu_new" || act == "gelu_pytorch_tanh",
                   "{}: activation_function '{}' is not supported; GPT-2 uses gelu_new", what, act);
    // Every GPT-2 checkpoint ties its head to wte; strata's GPT-2 has no lm_head of its own, so a
    // config that unties it (Hugging Face then loads lm_head.weight) is refused, not tied.
    STRATA_REQUIRE(s.get_bool("tie_word_embeddings", true),
                   "{}: tie_word_embeddings false: strata's GPT-2 ties its output head to "
                   "transformer.wte (as GPT-2 checkpoints do) and has no lm_head.weight of its "
                   "own; an untied GPT-2 is not supported",
                   what);
    c.tie_word_embeddings = true;
    c.scale_attn_weights = s.get_bool("scale_attn_weights", true);
    c.scale_attn_by_inverse_layer_idx = s.get_bool("scale_attn_by_inverse_layer_idx", false);
  } else {
    c.arch = ModelArch::kLlama;
    c.vocab_size = positive(s, "vocab_size", what);
    c.hidden_size = positive(s, "hidden_size", what);
    c.intermediate_size = positive(s, "intermediate_size", what);
    c.num_layers = positive(s, "num_hidden_layers", what);
    c.num_heads = positive(s, "num_attention_heads", what);
    c.num_kv_heads = positive(s, "num_key_value_heads", what, c.num_heads);
    c.max_positions = positive(s, "max_position_embeddings", what, 2048);
    c.norm_eps = s.get_double("rms_norm_eps", 1e-6);
    c.rope_theta = s.get_double("rope_theta", 10000.0);
    STRATA_REQUIRE(c.rope_theta > 0 && std::isfinite(c.rope_theta),
                   "{}: 'rope_theta' must be a number > 0 (the rotary base, 10000 or 500000 in "
                   "Llama configs), got {}",
                   what, c.rope_theta);
    // The window binds Mistral and Qwen2 (with use_sliding_window): its value read as Hugging
    // Face's attention uses it, a whole number (16.0 too) or null for none.
    if (type != "llama") {
      if (const auto* sw = s.raw("sliding_window"))
        STRATA_REQUIRE(sw->is_number() && sw->get<double>() >= 1 &&
                           sw->get<double>() == std::floor(sw->get<double>()) &&
                           sw->get<double>() <= 9.2e18,
                       "{}: 'sliding_window' must be a whole number of positions >= 1 (or null: "
                       "none), got {}",
                       what, sw->dump());
      if (const auto* use = s.raw("use_sliding_window"))
        STRATA_REQUIRE(use->is_boolean(), "{}: 'use_sliding_window' must be true or false, got {}",
                       what, use->dump());
    }
    c.tie_word_embeddings = s.get_bool("tie_word_embeddings", false);
    // Llama's attention_bias puts a bias on q, k, v and o; Qwen2 has q/k/v biases only; Hugging
    // Face's Mistral has none and ignores the key (so does strata).
    c.o_bias = type == "llama" && s.get_bool("attention_bias", false);
    c.qkv_bias = type == "qwen2" || c.o_bias;
    STRATA_REQUIRE(!s.get_bool("mlp_bias", false), "{}: mlp_bias = true is not supported", what);
    const std::string act = s.get_string("hidden_act", "silu");
    STRATA_REQUIRE(act == "silu",
                   "{}: hidden_act '{}' is not supported; the Llama family uses silu", what, act);
    if (const auto* rs = s.raw("rope_scaling")) {
      const config::Section r(rs, "rope_scaling");
      const std::string rt =
          r.has("rope_type") ? r.get_string("rope_type", "") : r.get_string("type", "");
      STRATA_REQUIRE(rt == "llama3" || rt == "default",
                     "{}: rope_scaling type '{}' is not supported; strata implements 'llama3'",
                     what, rt);
      if (rt == "llama3") {
        // Each key given, as Hugging Face's rope validation requires (no defaults to guess).
        for (const char* key :
             {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"})
          STRATA_REQUIRE(r.has(key),
                         "{}: rope_scaling of type 'llama3' needs '{}' (it has factor, "
                         "low_freq_factor, high_freq_factor and "
                         "original_max_position_embeddings, as Llama 3.1's config.json gives "
                         "them)",
                         what, key);
        c.rope_llama3_factor = r.get_double("factor", 8.0);
        c.rope_llama3_low_freq_factor = r.get_double("low_freq_factor", 1.0);
        c.rope_llama3_high_freq_factor = r.get_double("high_freq_factor", 4.0);
        c.rope_llama3_original_max_positions =
            r.get_double("original_max_position_embeddings", 8192);
        STRATA_REQUIRE(c.rope_llama3_factor > 0 && c.rope_llama3_low_freq_factor > 0 &&
                           c.rope_llama3_high_freq_factor > c.rope_llama3_low_freq_factor &&
                           c.rope_llama3_original_max_positions >= 1,
                       "{}: rope_scaling needs factor > 0, 0 < low_freq_factor < "
                       "high_freq_factor and original_max_position_embeddings >= 1",
                       what);
      }
    }
  }
  // The dtype the weights were saved in (transformers writes "torch_dtype", newer versions
  // "dtype", which it takes when both are there); a value that is not a string (null) is no
  // answer.
  for (const char* key : {"dtype", "torch_dtype"})
    if (const auto* d = s.raw(key); d && d->is_string() && c.torch_dtype.empty())
      c.torch_dtype = d->get<std::string>();
  STRATA_REQUIRE(c.norm_eps >= 0 && std::isfinite(c.norm_eps),
                 "{}: '{}' must be a number >= 0 (the norm's epsilon, e.g. 1e-5), got {}", what,
                 c.arch == ModelArch::kGpt2 ? "layer_norm_epsilon" : "rms_norm_eps", c.norm_eps);
  c.initializer_range = s.get_double("initializer_range", 0.02);
  STRATA_REQUIRE(c.initializer_range > 0, "{}: 'initializer_range' must be > 0, got {}", what,
                 c.initializer_range);
  STRATA_REQUIRE(
      c.hidden_size % c.num_heads == 0 || (c.arch == ModelArch::kLlama && s.has("head_dim")),
      "{}: hidden size {} is not a multiple of {} heads", what, c.hidden_size, c.num_heads);
  c.head_dim = c.arch == ModelArch::kLlama
                   ? positive(s, "head_dim", what, c.hidden_size / c.num_heads)
                   : c.hidden_size / c.num_heads;
  STRATA_REQUIRE(c.num_heads % c.num_kv_heads == 0,
                 "{}: num_attention_heads {} is not a multiple of num_key_value_heads {}", what,
                 c.num_heads, c.num_kv_heads);
  STRATA_REQUIRE(c.head_dim % 2 == 0 && c.head_dim <= 512,
                 "{}: head_dim {} must be even and <= 512", what, c.head_dim);
  // Sizes no model has, refused here: the layout's products would overflow 64 bits (2^62
  // intermediate elements planned as a few thousand parameters), or a layer count of 10^11 would
  // be laid out one unit at a time until memory ran out. Token ids are 32-bit.
  const auto at_most = [&](const char* key, std::int64_t v, std::int64_t limit) {
    STRATA_REQUIRE(v <= limit, "{}: '{}' = {} is beyond what strata runs (at most {})", what, key,
                   v, limit);
  };
  const bool gpt2 = c.arch == ModelArch::kGpt2;
  at_most("vocab_size", c.vocab_size, std::int64_t(std::numeric_limits<std::int32_t>::max()));
  at_most(gpt2 ? "n_embd" : "hidden_size", c.hidden_size, kMaxWidth);
  at_most(gpt2 ? "n_inner" : "intermediate_size", c.intermediate_size, kMaxWidth);
  at_most(gpt2 ? "n_head" : "num_attention_heads", c.num_heads, kMaxWidth);
  at_most(gpt2 ? "n_layer" : "num_hidden_layers", c.num_layers, kMaxLayers);
  at_most(gpt2 ? "n_positions" : "max_position_embeddings", c.max_positions,
          std::int64_t(std::numeric_limits<std::int32_t>::max()));
  // Each layer's and the embeddings' parameters, in floating point (no overflow), at most 2^48.
  const double h = double(c.hidden_size), hd = double(c.head_dim);
  const double layer = h * hd * double(2 * c.num_heads + 2 * c.num_kv_heads) +
                       3 * h * double(c.intermediate_size) + 4 * h;
  const double total = double(c.num_layers) * layer +
                       (c.tie_word_embeddings ? 1 : 2) * double(c.vocab_size) * h +
                       (gpt2 ? double(c.max_positions) * h : 0.0);  // GPT-2's learned positions
  STRATA_REQUIRE(total <= double(kMaxParams),
                 "{}: about {:.3g} parameters, beyond what strata runs (at most 2^48, {:.3g})",
                 what, total, double(kMaxParams));
  warn_near_misses(c, what);
  return c;
}

}  // namespace

// Every error names the file: the key checks of config::Section say only "config key 'x'",
// which reads as the --config (ds_config.json) file's.
ModelConfig parse_model_config(const std::string& json_text, const std::string& what) {
  try {
    return parse_model_config_body(json_text, what);
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::kInvalidArgument || e.message().rfind(what, 0) == 0) throw;
    STRATA_THROW(kInvalidArgument, "{}: {}", what, e.message());
  }
}

std::string checkpoint_not_model(const std::string& folder) {
  std::error_code ec;
  const fs::path dir(folder.empty() ? "." : folder);
  if (fs::exists(dir / "config.json", ec)) return "";
  // Its step folders here, or in checkpoints/ (a run's --out before the model was written).
  const auto has_steps = [&](const fs::path& d) {
    bool found = false;
    for (const auto& e : fs::directory_iterator(d, ec))
      found = found || (e.path().filename().string().starts_with("step-") &&
                        fs::exists(e.path() / "manifest.json", ec));
    return found;
  };
  const bool steps = has_steps(dir) || has_steps(dir / "checkpoints");
  if (!steps && !fs::exists(dir / "manifest.json", ec)) return "";
  return fmt::format(
      "{} {} strata-train checkpoint{}, not a Hugging Face model folder (no config.json): "
      "strata-export {} OUT writes the model from {}, then give OUT",
      folder, steps ? "holds" : "is a", steps ? "s (step-<N> folders)" : "", folder,
      steps ? "the newest" : "it");
}

ModelConfig load_model_config(const std::string& path) {
  // A strata-train checkpoint where a model folder belongs: said as what it is.
  const fs::path file(path);
  if (file.filename() == "config.json")
    if (const std::string why =
            checkpoint_not_model(file.has_parent_path() ? file.parent_path().string() : ".");
        !why.empty())
      STRATA_THROW(kInvalidArgument, "{}", why);
  return parse_model_config(read_text(path), path);
}

std::int64_t binding_sliding_window(const ModelConfig& c) {
  if (!c.raw.is_object()) return 0;
  // The window binds only where it is used: Qwen2's configs carry one with "use_sliding_window"
  // false, or without the key, whose default in Hugging Face's Qwen2Config is false (it then
  // attends over everything, as strata does); Mistral's always binds.
  // Llama's and GPT-2's attention has no window: a key left in their config is not used.
  if (c.model_type != "mistral" && c.model_type != "qwen2") return 0;
  const auto use = c.raw.find("use_sliding_window");
  const bool used =
      use != c.raw.end() && use->is_boolean() ? use->get<bool>() : c.model_type != "qwen2";
  const auto sw = c.raw.find("sliding_window");
  // (a whole number, 16.0 too: parse_model_config refused any other)
  return used && sw != c.raw.end() && sw->is_number() ? std::int64_t(sw->get<double>()) : 0;
}

std::string model_config_json(const ModelConfig& c) {
  if (!c.raw.is_null()) return c.raw.dump(2);
  nlohmann::json j;
  if (c.arch == ModelArch::kGpt2) {
    j = {{"architectures", {"GPT2LMHeadModel"}},
         {"model_type", "gpt2"},
         {"vocab_size", c.vocab_size},
         {"n_embd", c.hidden_size},
         {"n_layer", c.num_layers},
         {"n_head", c.num_heads},
         {"n_positions", c.max_positions},
         {"n_inner", c.intermediate_size},
         {"layer_norm_epsilon", c.norm_eps},
         {"activation_function", "gelu_new"},
         {"tie_word_embeddings", true},
         {"scale_attn_weights", c.scale_attn_weights},
         {"scale_attn_by_inverse_layer_idx", c.scale_attn_by_inverse_layer_idx}};
  } else {
    const char* arch = c.model_type == "qwen2"     ? "Qwen2ForCausalLM"
                       : c.model_type == "mistral" ? "MistralForCausalLM"
                                                   : "LlamaForCausalLM";
    j = {{"architectures", {arch}},
         {"model_type", c.model_type},
         {"vocab_size", c.vocab_size},
         {"hidden_size", c.hidden_size},
         {"intermediate_size", c.intermediate_size},
         {"num_hidden_layers", c.num_layers},
         {"num_attention_heads", c.num_heads},
         {"num_key_value_heads", c.num_kv_heads},
         {"head_dim", c.head_dim},
         {"max_position_embeddings", c.max_positions},
         {"rms_norm_eps", c.norm_eps},
         {"rope_theta", c.rope_theta},
         {"tie_word_embeddings", c.tie_word_embeddings},
         {"hidden_act", "silu"}};
    if (c.model_type == "llama") j["attention_bias"] = c.qkv_bias;
    if (c.rope_llama3_factor > 0)
      j["rope_scaling"] = {
          {"rope_type", "llama3"},
          {"factor", c.rope_llama3_factor},
          {"low_freq_factor", c.rope_llama3_low_freq_factor},
          {"high_freq_factor", c.rope_llama3_high_freq_factor},
          {"original_max_position_embeddings", c.rope_llama3_original_max_positions}};
  }
  j["initializer_range"] = c.initializer_range;
  j["torch_dtype"] = "float32";
  return j.dump(2);
}

std::size_t ParamSpec::full_index(std::size_t local) const {
  if (split_dim < 0) return local;
  // Row-major: local = (outer * dim_len + d) * inner + in, over this slice's shape.
  std::size_t inner = 1;
  for (std::size_t k = std::size_t(split_dim) + 1; k < shape.size(); ++k)
    inner *= std::size_t(shape[k]);
  const std::size_t len = std::size_t(shape[std::size_t(split_dim)]);
  const std::size_t full_len = std::size_t(full_shape[std::size_t(split_dim)]);
  const std::size_t in = local % inner, d = local / inner % len, outer = local / inner / len;
  const std::size_t part_len = len / std::size_t(split_parts);
  const std::size_t part = d / part_len, within = d % part_len;
  const std::size_t full_d =
      part * (full_len / std::size_t(split_parts)) + std::size_t(split_begin) + within;
  return (outer * full_len + full_d) * inner + in;
}

std::size_t ParamSpec::full_numel() const {
  if (!split()) return numel;
  std::size_t n = 1;
  for (auto d : full_shape) n *= std::size_t(d);
  return n;
}

std::size_t ParamSpec::contiguous_from(std::size_t local) const {
  if (local >= numel) return 0;
  if (!split()) return numel - local;
  // Within one run of the split dimension's indices of one part (and its inner elements).
  std::size_t inner = 1;
  for (std::size_t k = std::size_t(split_dim) + 1; k < shape.size(); ++k)
    inner *= std::size_t(shape[k]);
  const std::size_t part_len =
      std::size_t(shape[std::size_t(split_dim)]) / std::size_t(split_parts);
  const std::size_t d = local / inner % (part_len * std::size_t(split_parts));
  return std::min((part_len - d % part_len) * inner - local % inner, numel - local);
}

std::vector<float> tp_slice(const ParamSpec& p, const std::vector<float>& full) {
  const std::size_t full_numel = p.full_numel();
  STRATA_REQUIRE(full.size() == full_numel, "tp_slice: '{}' has {} elements, {} given", p.name,
                 full_numel, full.size());
  std::vector<float> out(p.numel);
  for (std::size_t i = 0; i < p.numel; ++i) out[i] = full[p.full_index(i)];
  return out;
}

void tp_place(const ParamSpec& p, const std::vector<float>& slice, std::vector<float>& full) {
  const std::size_t full_numel = p.full_numel();
  STRATA_REQUIRE(slice.size() == p.numel && full.size() == full_numel,
                 "tp_place: '{}' takes a slice of {} into {} elements; {} into {} given", p.name,
                 p.numel, full_numel, slice.size(), full.size());
  for (std::size_t i = 0; i < p.numel; ++i) full[p.full_index(i)] = slice[i];
}

std::vector<float> tp_unit_whole(const ModelConfig& cfg, std::size_t u,
                                 const std::vector<std::vector<float>>& slices) {
  const int n = int(slices.size());
  STRATA_REQUIRE(n >= 1, "tp_unit_whole: no slices of unit {}", u);
  std::vector<std::vector<UnitSpec>> layouts;
  for (int k = 0; k < n; ++k) {
    layouts.push_back(model_units(cfg, {n, k}));
    STRATA_REQUIRE(
        u < layouts.back().size() && slices[std::size_t(k)].size() >= layouts.back()[u].numel,
        "tp_unit_whole: TP rank {}'s unit {} has {} values, its layout {}", k, u,
        slices[std::size_t(k)].size(), u < layouts.back().size() ? layouts.back()[u].numel : 0);
  }
  const UnitSpec whole = model_units(cfg)[u];
  std::vector<float> out(whole.numel, 0.0f), tensor;
  for (std::size_t pi = 0; pi < whole.params.size(); ++pi) {
    const ParamSpec& f = whole.params[pi];
    tensor.assign(f.numel, 0.0f);
    for (int k = 0; k < n; ++k) {
      const ParamSpec& p = layouts[std::size_t(k)][u].params[pi];
      if (!p.split() && k > 0) continue;  // replicated: TP rank 0's
      const auto& src = slices[std::size_t(k)];
      tp_place(p,
               std::vector<float>(src.begin() + std::ptrdiff_t(p.offset),
                                  src.begin() + std::ptrdiff_t(p.offset + p.numel)),
               tensor);
    }
    std::copy(tensor.begin(), tensor.end(), out.begin() + std::ptrdiff_t(f.offset));
  }
  return out;
}

std::uint64_t largest_tensor(const std::vector<UnitSpec>& units) {
  std::uint64_t n = 0;
  for (const UnitSpec& u : units)
    for (const ParamSpec& p : u.params) n = std::max<std::uint64_t>(n, p.numel);
  return n;
}

std::vector<UnitSpec> model_units(const ModelConfig& c, TensorParallel tp) {
  const std::int64_t C = c.hidden_size, I = c.intermediate_size, V = c.vocab_size;
  const std::int64_t qd = c.num_heads * c.head_dim, kvd = c.num_kv_heads * c.head_dim;
  const std::int64_t n = tp.size;
  STRATA_REQUIRE(n >= 1 && tp.rank >= 0 && tp.rank < n,
                 "model_units: tensor-parallel rank {} of {} is not a rank of the group", tp.rank,
                 n);
  // The vocabulary in rows: ceil(V / n) a rank, the last one fewer.
  const std::int64_t vrows = (V + n - 1) / n, v0 = std::min(V, tp.rank * vrows);
  const std::int64_t vlocal = std::min(vrows, V - v0);
  if (n > 1) {
    const auto need = [&](std::int64_t what, const char* name) {
      STRATA_REQUIRE(what % n == 0,
                     "tensor parallelism {} does not divide the model's {} ({}): each TP rank "
                     "holds an equal share of them; use a TP size that divides {}",
                     n, name, what, what);
    };
    // Named by the config.json keys of the model's family.
    const bool gpt2 = c.model_type == "gpt2";
    need(c.num_heads, gpt2 ? "attention heads (n_head)" : "attention heads (num_attention_heads)");
    if (!gpt2) need(c.num_kv_heads, "key/value heads (num_key_value_heads)");
    need(I, gpt2 ? "MLP width (n_inner, default 4 x n_embd)" : "MLP width (intermediate_size)");
    // The largest TP size below that splits everything here (1 at least): what to suggest.
    std::int64_t fits = 1;
    for (std::int64_t m = n - 1; m > 1 && fits == 1; --m)
      if (c.num_heads % m == 0 && (gpt2 || c.num_kv_heads % m == 0) && I % m == 0 &&
          (m - 1) * ((V + m - 1) / m) < V)
        fits = m;
    STRATA_REQUIRE((n - 1) * vrows < V,
                   "tensor parallelism {} leaves TP rank {} no vocabulary rows ({} rows in shares "
                   "of {}): use a smaller TP size ({} is the largest that splits this model)",
                   n, n - 1, V, vrows, fits);
  }
  std::vector<UnitSpec> units;
  // `aligned`: the parameter starts at a multiple of kParamAlign; else right after the previous
  // one (q, k, v and gate, up are each one matrix). Split along `dim` in `parts` parts, this
  // rank's [begin, begin + len) of each; dim -1: whole.
  auto put = [&](UnitSpec& u, std::string name, std::vector<std::int64_t> full, bool aligned,
                 int dim = -1, int parts = 1, std::int64_t begin = 0, std::int64_t len = 0) {
    ParamSpec p;
    p.name = std::move(name);
    p.full_shape = full;
    p.shape = std::move(full);
    if (n > 1 && dim >= 0) {
      if (len == 0) {  // an equal share of each part
        len = p.shape[std::size_t(dim)] / parts / n;
        begin = tp.rank * len;
      }
      p.split_dim = dim;
      p.split_parts = parts;
      p.split_begin = begin;
      p.shape[std::size_t(dim)] = parts * len;
    }
    p.numel = 1;
    for (auto d : p.shape) p.numel *= static_cast<std::size_t>(d);
    p.offset = aligned ? (u.numel + kParamAlign - 1) / kParamAlign * kParamAlign : u.numel;
    u.numel = p.offset + p.numel;
    u.params.push_back(std::move(p));
  };
  auto add = [&](UnitSpec& u, std::string name, std::vector<std::int64_t> shape, int dim = -1,
                 int parts = 1) { put(u, std::move(name), std::move(shape), true, dim, parts); };
  auto next = [&](UnitSpec& u, std::string name, std::vector<std::int64_t> shape, int dim = -1) {
    put(u, std::move(name), std::move(shape), false, dim);
  };
  auto vocab = [&](UnitSpec& u, std::string name) {
    put(u, std::move(name), {V, C}, true, 0, 1, v0, vlocal);
  };
  const bool gpt2 = c.arch == ModelArch::kGpt2;
  UnitSpec embed{"embed", {}, 0};
  if (gpt2) {
    vocab(embed, "transformer.wte.weight");
    add(embed, "transformer.wpe.weight", {c.max_positions, C});
  } else {
    vocab(embed, "model.embed_tokens.weight");
  }
  units.push_back(std::move(embed));
  for (std::int64_t l = 0; l < c.num_layers; ++l) {
    UnitSpec u{fmt::format("layers.{}", l), {}, 0};
    if (gpt2) {
      // Conv1D weights are [in, out]: column-parallel splits dimension 1, row-parallel 0.
      const std::string p = fmt::format("transformer.h.{}.", l);
      add(u, p + "ln_1.weight", {C});
      add(u, p + "ln_1.bias", {C});
      add(u, p + "attn.c_attn.weight", {C, 3 * C}, 1, 3);
      add(u, p + "attn.c_attn.bias", {3 * C}, 0, 3);
      add(u, p + "attn.c_proj.weight", {C, C}, 0);
      add(u, p + "attn.c_proj.bias", {C});
      add(u, p + "ln_2.weight", {C});
      add(u, p + "ln_2.bias", {C});
      add(u, p + "mlp.c_fc.weight", {C, I}, 1);
      add(u, p + "mlp.c_fc.bias", {I}, 0);
      add(u, p + "mlp.c_proj.weight", {I, C}, 0);
      add(u, p + "mlp.c_proj.bias", {C});
    } else {
      const std::string p = fmt::format("model.layers.{}.", l);
      add(u, p + "input_layernorm.weight", {C});
      // Unaligned on purpose: q, k, v must be one contiguous [(nh + 2 nkv) hd, C] matrix (this
      // rank's heads of each under TP).
      add(u, p + "self_attn.q_proj.weight", {qd, C}, 0);
      next(u, p + "self_attn.k_proj.weight", {kvd, C}, 0);
      next(u, p + "self_attn.v_proj.weight", {kvd, C}, 0);
      if (c.qkv_bias) {
        add(u, p + "self_attn.q_proj.bias", {qd}, 0);
        next(u, p + "self_attn.k_proj.bias", {kvd}, 0);
        next(u, p + "self_attn.v_proj.bias", {kvd}, 0);
      }
      add(u, p + "self_attn.o_proj.weight", {C, qd}, 1);
      if (c.o_bias) add(u, p + "self_attn.o_proj.bias", {C});
      add(u, p + "post_attention_layernorm.weight", {C});
      add(u, p + "mlp.gate_proj.weight", {I, C}, 0);
      next(u, p + "mlp.up_proj.weight", {I, C}, 0);
      add(u, p + "mlp.down_proj.weight", {C, I}, 1);
    }
    units.push_back(std::move(u));
  }
  UnitSpec head{"head", {}, 0};
  if (gpt2) {
    add(head, "transformer.ln_f.weight", {C});
    add(head, "transformer.ln_f.bias", {C});
  } else {
    add(head, "model.norm.weight", {C});
    if (!c.tie_word_embeddings) vocab(head, "lm_head.weight");
  }
  units.push_back(std::move(head));
  for (auto& u : units) u.numel = (u.numel + kParamAlign - 1) / kParamAlign * kParamAlign;
  return units;
}

}  // namespace strata
