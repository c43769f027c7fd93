// strata-generate: what a Hugging Face folder's model says, token by token, on any strata device.
//
//   strata-generate --model DIR (--prompt TEXT | --prompt-ids "1 2 3") [--max-new-tokens N]
//                   [--temperature T] [--top-p P] [--top-k K] [--seed S] [--device cpu|cuda]
//
// The model runs in the dtype it was saved in (config.json's torch_dtype: bfloat16 -> bf16, else
// fp32; --dtype overrides) with a key/value cache (--no-kv-cache: the full forward for every
// token, the reference path). Tokens print as they come. --prompt TEXT goes through the
// folder's tokenizer.json (strata/tokenizer.h) and the new tokens print as text; a byte-level
// model (vocab_size 256, no tokenizer.json: what strata-train --text trains) reads and prints
// bytes; --prompt-ids takes ids, and without a usable tokenizer the new tokens print as ids.
// Sampling follows the folder's generation_config.json (do_sample, temperature, top_p, top_k)
// unless flags say otherwise; greedy without one. Generation ends at max_new_tokens or at the
// eos_token_id of generation_config.json / config.json (--ignore-eos: not).
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "strata/device.h"
#include "strata/error.h"
#include "strata/generate.h"
#include "strata/model.h"
#include "strata/model_io.h"
#include "strata/tokenizer.h"
#include "tool_main.h"

namespace {

namespace fs = std::filesystem;

struct Options {
  std::string model_dir, prompt, prompt_ids, device = "auto", dtype = "auto";
  bool chat = false, no_kv_cache = false, ignore_eos = false, ids = false, json = false;
  std::int64_t max_new_tokens = 64, context = 0;
  double temperature = -1, top_p = -1;
  std::int64_t top_k = -1;
  std::uint64_t seed = 0;
};

// eos_token_id: an id or a list of them, from generation_config.json, else config.json.
std::vector<std::int32_t> stop_ids(const nlohmann::json& gen, const nlohmann::json& cfg) {
  const nlohmann::json* src = nullptr;
  if (gen.is_object() && gen.contains("eos_token_id"))
    src = &gen["eos_token_id"];
  else if (cfg.is_object() && cfg.contains("eos_token_id"))
    src = &cfg["eos_token_id"];
  std::vector<std::int32_t> out;
  if (!src) return out;
  if (src->is_number_integer()) out.push_back(src->get<std::int32_t>());
  if (src->is_array())
    for (const auto& v : *src)
      if (v.is_number_integer()) out.push_back(v.get<std::int32_t>());
  return out;
}

int run(const Options& o) {
  const fs::path dir(o.model_dir);
  std::error_code ec;
  STRATA_REQUIRE(fs::is_directory(dir, ec),
                 "--model {}: no such folder (give a Hugging Face "
                 "folder: config.json and safetensors, as strata-train --out writes)",
                 o.model_dir);
  STRATA_REQUIRE(!o.chat,
                 "--chat needs the model's chat template, which strata-generate does not render "
                 "yet: apply the template yourself and give the result as --prompt TEXT (or its "
                 "token ids as --prompt-ids)");
  STRATA_REQUIRE(o.prompt.empty() != o.prompt_ids.empty(),
                 "give the prompt once: --prompt TEXT (a byte-level model) or --prompt-ids \"ID "
                 "ID ...\"");
  const strata::ModelConfig cfg = strata::load_model_config((dir / "config.json").string());
  const nlohmann::json gen =
      fs::exists(dir / "generation_config.json", ec)
          ? strata::tools::read_json_file((dir / "generation_config.json").string())
          : nlohmann::json::object();
  // The folder's tokenizer.json when there is one (one this tokenizer cannot run: ids only, and
  // --prompt says why); a byte-level model (vocab 256) without one reads and prints bytes.
  const bool has_tokenizer = fs::exists(dir / "tokenizer.json", ec);
  std::optional<strata::Tokenizer> tok;
  std::string tok_error;
  if (has_tokenizer) {
    try {
      tok = strata::Tokenizer::from_folder(dir);
    } catch (const strata::Error& e) {
      tok_error = e.user_message();
    }
  }
  const bool byte_level = cfg.vocab_size == 256 && !has_tokenizer;

  std::vector<std::int32_t> prompt;
  if (!o.prompt.empty()) {
    if (tok) {
      prompt = tok->encode(o.prompt, /*add_special_tokens=*/true);
      for (std::int32_t id : prompt)
        STRATA_REQUIRE(id < cfg.vocab_size,
                       "--prompt: {}/tokenizer.json gives id {}, beyond the model's vocab_size {}: "
                       "the tokenizer is not this model's",
                       o.model_dir, id, cfg.vocab_size);
      STRATA_REQUIRE(!prompt.empty(), "--prompt '{}' encodes to no token: give some text",
                     o.prompt);
    } else {
      STRATA_REQUIRE(byte_level,
                     "--prompt TEXT needs the model's tokenizer, and {}: give the prompt's token "
                     "ids with --prompt-ids \"ID ID ...\"",
                     has_tokenizer ? fmt::format("{}/tokenizer.json cannot be used ({})",
                                                 o.model_dir, tok_error)
                                   : fmt::format("{} has no tokenizer.json (vocab_size {})",
                                                 o.model_dir, cfg.vocab_size));
      for (unsigned char c : o.prompt) prompt.push_back(c);
    }
  } else {
    prompt = strata::parse_token_ids(o.prompt_ids, cfg.vocab_size, "--prompt-ids");
  }
  const bool text_out = (tok || byte_level) && !o.ids;

  strata::GenerateOptions g;
  g.max_new_tokens = o.max_new_tokens;
  g.kv_cache = !o.no_kv_cache;
  if (!o.ignore_eos) {
    g.stop_ids = stop_ids(gen, cfg.raw);
    if (g.stop_ids.empty() && tok && tok->eos_id()) g.stop_ids.push_back(*tok->eos_id());
  }
  // Sampling: the flags, else generation_config.json's (do_sample true), else greedy.
  const bool cfg_samples = gen.value("do_sample", false);
  auto gen_num = [&](const char* key, double def) {
    return gen.contains(key) && gen[key].is_number() ? gen[key].get<double>() : def;
  };
  g.sampling.temperature =
      o.temperature >= 0 ? o.temperature : (cfg_samples ? gen_num("temperature", 1.0) : 0.0);
  g.sampling.top_p = o.top_p >= 0 ? o.top_p : (cfg_samples ? gen_num("top_p", 1.0) : 1.0);
  g.sampling.top_k =
      o.top_k >= 0 ? o.top_k : (cfg_samples ? std::int64_t(gen_num("top_k", 0.0)) : 0);
  g.sampling.seed = o.seed;
  STRATA_REQUIRE(g.sampling.temperature > 0 || (o.top_p < 0 && o.top_k < 0),
                 "--top-p and --top-k shape sampling, and temperature 0 is greedy: give "
                 "--temperature T > 0 too");
  strata::check_sampling(g.sampling);

  const std::int64_t need =
      std::int64_t(prompt.size()) + std::max<std::int64_t>(o.max_new_tokens, 1) - 1;
  const std::int64_t ctx = o.context > 0 ? o.context : need;
  STRATA_REQUIRE(ctx >= need,
                 "--context {} is shorter than the prompt ({} tokens) and --max-new-tokens {} "
                 "need ({})",
                 ctx, prompt.size(), o.max_new_tokens, need);
  STRATA_REQUIRE(ctx <= cfg.max_positions,
                 "the prompt ({} tokens) and --max-new-tokens {} need {} positions; the model "
                 "takes {} (config.json's {}): shorten them",
                 prompt.size(), o.max_new_tokens, ctx, cfg.max_positions,
                 cfg.arch == strata::ModelArch::kGpt2 ? "n_positions" : "max_position_embeddings");

  const strata::DType dt =
      o.dtype == "bf16" ? strata::DType::kBF16
      : o.dtype == "fp32"
          ? strata::DType::kF32
          : (cfg.torch_dtype == "bfloat16" ? strata::DType::kBF16 : strata::DType::kF32);
  auto dev = strata::make_device(o.device);
  auto stream = dev->create_stream("generate");
  strata::Model model(cfg, *dev, *stream, {.micro_batch = 1, .seq_len = ctx, .compute = dt});
  strata::ResidentWeights w(model, *stream);
  strata::load_hf_weights(o.model_dir, w);

  if (!o.json)
    std::fprintf(stderr, "strata-generate: %s (%s, %s on %s), %s%s\n", o.model_dir.c_str(),
                 cfg.model_type.c_str(), std::string(strata::dtype_name(dt)).c_str(),
                 std::string(dev->name()).c_str(),
                 g.sampling.temperature == 0 ? "greedy" : "sampling",
                 g.kv_cache ? "" : ", no key/value cache");
  std::FILE* out = o.json ? stderr : stdout;
  auto put = [&](const std::string& text) { std::fwrite(text.data(), 1, text.size(), out); };
  if (text_out)  // the prompt first, as the model continues it
    put(o.prompt.empty() && tok ? tok->decode(prompt, /*skip_special_tokens=*/true) : o.prompt);
  std::fflush(out);
  std::optional<strata::TokenStreamDecoder> stream_text;
  if (text_out && tok) stream_text.emplace(*tok, /*skip_special_tokens=*/true);
  const strata::GenerateResult r = strata::generate(model, w, prompt, g, [&](std::int32_t id) {
    if (stream_text && id < tok->vocab_size())
      put(stream_text->push(id));  // a character split over tokens prints when whole
    else if (stream_text)          // beyond the tokenizer (a padded vocabulary's untrained row)
      put(stream_text->finish() + "[id " + std::to_string(id) + "]");
    else if (text_out)
      put(std::string(1, static_cast<char>(id)));
    else
      std::fprintf(out, "%d ", id);
    std::fflush(out);
  });
  if (stream_text) put(stream_text->finish());
  std::fputc('\n', out);
  std::fflush(out);
  const double tps =
      r.tokens.size() > 1 && r.decode_s > 0 ? double(r.tokens.size() - 1) / r.decode_s : 0.0;
  if (o.json) {
    nlohmann::json j = {{"prompt_tokens", prompt.size()},
                        {"new_tokens", r.tokens},
                        {"stopped_on_eos", r.stopped},
                        {"kv_cache", g.kv_cache},
                        {"dtype", std::string(strata::dtype_name(dt))},
                        {"device", std::string(dev->name())},
                        {"prompt_s", r.prompt_s},
                        {"decode_s", r.decode_s},
                        {"decode_tokens_per_s", tps}};
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::fprintf(stderr,
                 "strata-generate: %zu new tokens%s; prompt of %zu tokens to the first in %.3f s, "
                 "then %.1f tokens/s\n",
                 r.tokens.size(), r.stopped ? " (ended on eos)" : "", prompt.size(), r.prompt_s,
                 tps);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  strata::reexec_with_passive_openmp(argv);  // before libgomp's first team: see device.h
  Options o;
  CLI::App app{
      "strata-generate: text from a Hugging Face folder's model (Llama family, GPT-2), token by "
      "token, with a key/value cache."};
  app.add_option("--model", o.model_dir, "the model's folder (config.json + safetensors)")
      ->required();
  app.add_option("--prompt", o.prompt,
                 "the prompt as text, through the folder's tokenizer.json (a byte-level model, "
                 "vocab_size 256 without one: its bytes)");
  app.add_option("--prompt-ids", o.prompt_ids, "the prompt as token ids: \"1 2 3\" or \"1,2,3\"");
  app.add_flag("--chat", o.chat, "apply the model's chat template (not yet: refused)");
  app.add_option("--max-new-tokens", o.max_new_tokens, "tokens to generate (default 64)")
      ->check(strata::tools::kCount);
  app.add_option("--temperature", o.temperature,
                 "0: greedy; > 0: sample from softmax(logits / T) (default: "
                 "generation_config.json's when it samples, else 0)")
      ->check(strata::tools::kNonNegative);
  app.add_option("--top-p", o.top_p, "nucleus sampling: the most likely tokens up to P (0, 1]")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--top-k", o.top_k, "sample among the K most likely tokens (0: all)")
      ->check(strata::tools::kCount);
  app.add_option("--seed", o.seed, "the sampler's seed (default 0)");
  app.add_option("--device", o.device, "auto | cpu | cuda (default auto)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  app.add_option("--dtype", o.dtype,
                 "auto (config.json's torch_dtype: bfloat16 -> bf16, else fp32) | fp32 | bf16")
      ->check(CLI::IsMember({"auto", "fp32", "bf16"}));
  app.add_option("--context", o.context,
                 "positions the key/value cache holds (default: prompt + --max-new-tokens)")
      ->check(strata::tools::kCount);
  app.add_flag("--no-kv-cache", o.no_kv_cache,
               "run the full forward for every token (the reference path; slow)");
  app.add_flag("--ignore-eos", o.ignore_eos, "do not stop at the model's eos_token_id");
  app.add_flag("--ids", o.ids, "print the new tokens' ids, not their text");
  app.add_flag("--json", o.json,
               "print, last, one JSON object: the new token ids and timings (the text to stderr)");
  return strata::tools::run_tool("strata-generate", app, argc, argv, [&] { return run(o); });
}
