// strata-generate: what a Hugging Face folder's model says, token by token, on any strata device.
//
//   strata-generate --model DIR (--prompt TEXT | --prompt-ids "1 2 3") [--max-new-tokens N]
//                   [--temperature T] [--top-p P] [--top-k K] [--seed S] [--device cpu|cuda]
//   strata-generate --model DIR --chat [--system TEXT] [--chat-format
//   chatml|llama3|llama2|mistral|none]
//                   [--chat-date "02 Dec 2026"]
//
// The model runs in the dtype it was saved in (config.json's torch_dtype: bfloat16 -> bf16, else
// fp32; --dtype overrides) with a key/value cache (--no-kv-cache: the full forward for every
// token, the reference path). Tokens print as they come. --prompt TEXT goes through the
// folder's tokenizer.json (strata/tokenizer.h) and the new tokens print as text; a byte-level
// model (vocab_size 256 or less, no tokenizer.json: what strata-train --text trains) reads and
// prints bytes; --prompt-ids takes ids, and without a usable tokenizer the new tokens print as ids.
// Sampling follows the folder's generation_config.json (do_sample, temperature, top_p, top_k)
// unless flags say otherwise; greedy without one. Generation ends at max_new_tokens or at the
// eos_token_id of generation_config.json / config.json (--ignore-eos: not).
//
// --chat: a conversation on stdin/stdout. Each line read is a user message; the whole conversation
// is rendered with the folder's chat template (strata/chat.h) and encoded; when the new prompt
// begins with what the key/value cache holds (the last prompt and reply, the reply encoding back to
// the tokens generated) only the rest runs, else the whole prompt runs again (Qwen3's template
// rewrites earlier assistant turns, and a reply's text may encode to other tokens); the reply
// streams until the template's end-of-turn token. EOF or "/exit" ends it.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "strata/chat.h"
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
  std::string system, chat_format, chat_date;
  bool system_given = false;
  bool chat = false, no_kv_cache = false, ignore_eos = false, ids = false, json = false;
  std::int64_t max_new_tokens = 64, context = 0;
  double temperature = -1, top_p = -1;
  std::int64_t top_k = -1;
  std::uint64_t seed = 0;
};

// generation_config.json as Hugging Face's GenerationConfig reads it: a key set to null is a key
// left out, and top_k is 50 unless the file gives one. A value of the wrong type is an error naming
// the file, the key and the value, never a setting silently dropped or truncated.
struct GenConfig {
  bool do_sample = false;
  double temperature = 1.0, top_p = 1.0;
  std::int64_t top_k = 50;
  nlohmann::json raw = nlohmann::json::object();  // for eos_token_id
};

GenConfig read_generation_config(const fs::path& dir) {
  GenConfig c;
  const fs::path file = dir / "generation_config.json";
  std::error_code ec;
  if (!fs::exists(file, ec)) return c;
  const std::string path = file.string();
  c.raw = strata::tools::read_json_file(path);
  auto shown = [](const nlohmann::json& v) {
    std::string text = v.dump();
    return text.size() > 60 ? text.substr(0, 57) + "..." : text;
  };
  STRATA_REQUIRE(
      c.raw.is_object(),
      "{} holds {}, not an object of generation settings ({{\"do_sample\": true, ...}}): "
      "fix or remove the file",
      path, shown(c.raw));
  auto get = [&](const char* key, bool ok(const nlohmann::json&),
                 const char* want) -> const nlohmann::json* {
    const auto it = c.raw.find(key);
    if (it == c.raw.end() || it->is_null()) return nullptr;
    STRATA_REQUIRE(ok(*it), "{}: \"{}\" is {}, not {}: fix the value or remove the key", path, key,
                   shown(*it), want);
    return &*it;
  };
  const auto boolean = [](const nlohmann::json& v) { return v.is_boolean(); };
  const auto number = [](const nlohmann::json& v) { return v.is_number(); };
  const auto whole = [](const nlohmann::json& v) {
    return v.is_number_integer() &&
           !(v.is_number_unsigned() &&
             v.get<std::uint64_t>() > std::uint64_t(std::numeric_limits<std::int64_t>::max()));
  };
  if (const auto* v = get("do_sample", boolean, "true or false")) c.do_sample = v->get<bool>();
  if (const auto* v = get("temperature", number, "a number")) c.temperature = v->get<double>();
  if (const auto* v = get("top_p", number, "a number")) c.top_p = v->get<double>();
  if (const auto* v = get("top_k", whole, "a whole number")) c.top_k = v->get<std::int64_t>();
  return c;
}

// The eos_token_id of `obj` (the file `path`): an id or a list of them; nullopt where the key is
// left out or null (the next file's then counts). Anything else is an error naming the file and
// the value: a string or an id past 32 bits was dropped or wrapped (4294967326 stopped at 30).
std::optional<std::vector<std::int32_t>> eos_ids(const nlohmann::json& obj,
                                                 const std::string& path) {
  if (!obj.is_object()) return std::nullopt;
  const auto it = obj.find("eos_token_id");
  if (it == obj.end() || it->is_null()) return std::nullopt;
  const auto id = [](const nlohmann::json& v) {
    return v.is_number_unsigned() ? v.get<std::uint64_t>() <= 0x7fffffffu
                                  : v.is_number_integer() && v.get<std::int64_t>() >= 0 &&
                                        v.get<std::int64_t>() <= 0x7fffffff;
  };
  const bool ok = id(*it) || (it->is_array() && std::all_of(it->begin(), it->end(), id));
  std::string shown = it->dump();
  if (shown.size() > 60) shown = shown.substr(0, 57) + "...";
  STRATA_REQUIRE(ok,
                 "{}: \"eos_token_id\" is {}, not a token id (a whole number from 0 to 2^31 - 1) "
                 "or a list of them: fix the value or remove the key",
                 path, shown);
  std::vector<std::int32_t> out;
  if (it->is_array())
    for (const auto& v : *it) out.push_back(v.get<std::int32_t>());
  else
    out.push_back(it->get<std::int32_t>());
  return out;
}

// eos_token_id from generation_config.json, else config.json.
std::vector<std::int32_t> stop_ids(const Options& o, const nlohmann::json& gen,
                                   const nlohmann::json& cfg) {
  const fs::path dir(o.model_dir);
  if (auto ids = eos_ids(gen, (dir / "generation_config.json").string())) return *ids;
  return eos_ids(cfg, (dir / "config.json").string()).value_or(std::vector<std::int32_t>{});
}

// The sampling and stopping of a run: the flags, else generation_config.json's, else greedy.
strata::GenerateOptions generate_options(const Options& o, const GenConfig& gen,
                                         const nlohmann::json& cfg_raw,
                                         const std::optional<strata::Tokenizer>& tok) {
  strata::GenerateOptions g;
  g.max_new_tokens = o.max_new_tokens;
  g.kv_cache = !o.no_kv_cache;
  if (!o.ignore_eos) {
    g.stop_ids = stop_ids(o, gen.raw, cfg_raw);
    if (g.stop_ids.empty() && tok && tok->eos_id()) g.stop_ids.push_back(*tok->eos_id());
  }
  const bool cfg_samples = gen.do_sample;
  g.sampling.temperature = o.temperature >= 0 ? o.temperature : (cfg_samples ? gen.temperature : 0);
  g.sampling.top_p = o.top_p >= 0 ? o.top_p : (cfg_samples ? gen.top_p : 1.0);
  g.sampling.top_k = o.top_k >= 0 ? o.top_k : (cfg_samples ? gen.top_k : 0);
  g.sampling.seed = o.seed;
  STRATA_REQUIRE(g.sampling.temperature > 0 || (o.top_p < 0 && o.top_k < 0),
                 "--top-p and --top-k shape sampling, and temperature 0 is greedy: give "
                 "--temperature T > 0 too");
  try {
    strata::check_sampling(g.sampling);
  } catch (const strata::Error& e) {
    // The flags' values are checked on the command line: this one came from the folder's
    // generation_config.json.
    if (!cfg_samples) throw;
    STRATA_THROW(kInvalidArgument,
                 "{} (from the model folder's generation_config.json, whose do_sample is true; "
                 "--temperature, --top-p and --top-k override it)",
                 e.message());
  }
  return g;
}

// "N (config.json's KEY)", the positions a model takes, for messages.
std::string limit_text(const strata::ContextLimit& limit) {
  return fmt::format("{} (config.json's {}{})", limit.positions, limit.key,
                     limit.key == "sliding_window" ? ": strata's attention is full causal" : "");
}

// --context beyond what the model takes is refused naming it, before anything is measured
// against it.
void check_context_flag(const Options& o, const strata::ContextLimit& limit) {
  STRATA_REQUIRE(o.context <= limit.positions,
                 "--context {} is more than the model takes, {}: give --context {} or less",
                 o.context, limit_text(limit), limit.positions);
}

// The model on its device, its weights resident, for `ctx` positions.
struct LoadedModel {
  strata::DType dtype;
  std::unique_ptr<strata::Device> dev;
  std::unique_ptr<strata::Stream> stream;
  std::unique_ptr<strata::Model> model;
  std::unique_ptr<strata::ResidentWeights> weights;
};

LoadedModel load_model(const Options& o, const strata::ModelConfig& cfg, std::int64_t ctx) {
  LoadedModel m;
  m.dtype = o.dtype == "bf16" ? strata::DType::kBF16
            : o.dtype == "fp32"
                ? strata::DType::kF32
                : (cfg.torch_dtype == "bfloat16" ? strata::DType::kBF16 : strata::DType::kF32);
  m.dev = strata::make_device(o.device);
  m.stream = m.dev->create_stream("generate");
  m.model = std::make_unique<strata::Model>(
      cfg, *m.dev, *m.stream,
      strata::ModelOptions{.micro_batch = 1, .seq_len = ctx, .compute = m.dtype});
  m.weights = std::make_unique<strata::ResidentWeights>(*m.model, *m.stream);
  strata::load_hf_weights(o.model_dir, *m.weights);
  return m;
}

void announce(const Options& o, const strata::ModelConfig& cfg, const LoadedModel& m,
              const strata::GenerateOptions& g, const std::string& extra = {}) {
  std::fprintf(stderr, "strata-generate: %s (%s, %s on %s), %s%s%s\n", o.model_dir.c_str(),
               cfg.model_type.c_str(), std::string(strata::dtype_name(m.dtype)).c_str(),
               std::string(m.dev->name()).c_str(),
               g.sampling.temperature == 0 ? "greedy" : "sampling",
               g.kv_cache ? "" : ", no key/value cache", extra.c_str());
}

double decode_rate(const strata::GenerateResult& r) {
  return r.tokens.size() > 1 && r.decode_s > 0 ? double(r.tokens.size() - 1) / r.decode_s : 0.0;
}

// --chat: user messages from stdin, one a line, until EOF or "/exit" (or the one --prompt TEXT);
// each turn re-renders the whole conversation with the generation prompt and runs what the cache
// does not hold yet.
int run_chat(const Options& o, const strata::ModelConfig& cfg, const GenConfig& gen,
             const std::optional<strata::Tokenizer>& tok, const std::string& tok_why) {
  STRATA_REQUIRE(!o.ids,
                 "--ids prints a run's new token ids, and --chat prints each reply as text: give "
                 "--json for each turn's ids (its \"new_tokens\"), or leave --ids out");
  STRATA_REQUIRE(
      o.prompt_ids.empty(),
      "--chat renders messages as text with the chat template: give the user's "
      "message with --prompt TEXT (one turn) or on stdin, a line each, not --prompt-ids");
  const bool one_turn = !o.prompt.empty();
  STRATA_REQUIRE(tok.has_value(), "--chat needs the model's tokenizer, and {}", tok_why);
  const strata::ChatTemplate t =
      o.chat_format.empty() ? strata::chat_template_from_folder(o.model_dir)
                            : strata::chat_template_for(strata::parse_chat_format(o.chat_format));
  strata::RenderOptions ro = strata::render_options_for(*tok);
  ro.add_generation_prompt = true;
  ro.date_string = o.chat_date;
  const std::string eot = strata::end_of_turn(t, ro);
  const std::optional<std::int32_t> eot_id = tok->token_to_id(eot);
  STRATA_REQUIRE(eot_id.has_value(),
                 "the {} layout ends a turn with '{}', which {}'s tokenizer does not have: "
                 "pick the model's layout with --chat-format chatml|llama3|llama2|mistral|none",
                 strata::chat_format_name(t.format), eot.empty() ? "(no eos token)" : eot,
                 o.model_dir);
  strata::GenerateOptions g = generate_options(o, gen, cfg.raw, tok);
  g.stop_ids.push_back(*eot_id);
  // The whole conversation must fit the cache: --context, else the model's positions (the
  // sliding window where it binds) up to 4096.
  const strata::ContextLimit limit = strata::context_limit(cfg);
  check_context_flag(o, limit);
  const std::int64_t ctx =
      o.context > 0 ? o.context : std::min<std::int64_t>(limit.positions, 4096);
  STRATA_REQUIRE(strata::generate_positions(1, g.max_new_tokens) <= std::uint64_t(ctx),
                 "--max-new-tokens {} does not fit the {} positions the conversation has{}: give "
                 "at most {}",
                 g.max_new_tokens, ctx, o.context > 0 ? " (--context)" : "", ctx);
  LoadedModel m = load_model(o, cfg, ctx);
  if (!o.json) {
    std::string note;
    for (const auto& n : t.not_reproduced) note += (note.empty() ? "" : ", ") + n;
    announce(o, cfg, m, g,
             fmt::format(", chat ({}{}{}){}", strata::chat_format_name(t.format),
                         note.empty() ? "" : "; the template's ",
                         note.empty() ? "" : note + " are not rendered",
                         one_turn ? ", one turn" : "; a message a line, /exit or EOF ends"));
  }
  std::vector<strata::ChatMessage> history;
  std::vector<std::int32_t> held;  // what the model's key/value cache holds
  if (o.system_given) history.push_back({"system", o.system});
  std::FILE* out = o.json ? stderr : stdout;
  std::string line;
  bool prompt_given = false;
  std::int64_t line_no = 0;  // of stdin
  const auto next_message = [&] {
    ++line_no;
    if (!one_turn) return bool(std::getline(std::cin, line));
    if (prompt_given) return false;
    prompt_given = true;
    line = o.prompt;
    return true;
  };
  for (int turn = 0; next_message();) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line == "/exit") break;
    if (line.empty()) continue;
    // A message that is not UTF-8 cannot be encoded: say where, and go on without it.
    if (const std::size_t bad = strata::first_invalid_utf8(line); bad != std::string::npos) {
      STRATA_REQUIRE(!one_turn,
                     "--prompt is not valid UTF-8 at byte {} (0x{:02x}): give UTF-8 text", bad,
                     static_cast<unsigned char>(line[bad]));
      std::fprintf(stderr,
                   "strata-generate: line %lld of stdin is not valid UTF-8 at byte %zu (0x%02x): "
                   "the message is skipped, the conversation goes on\n",
                   static_cast<long long>(line_no), bad,
                   static_cast<unsigned>(static_cast<unsigned char>(line[bad])));
      continue;
    }
    history.push_back({"user", line});
    const std::vector<std::int32_t> prompt = strata::encode_chat(*tok, t, history, ro).tokens;
    for (std::int32_t id : prompt)
      STRATA_REQUIRE(id < cfg.vocab_size,
                     "{}'s tokenizer gives id {}, beyond the model's vocab_size {}: the "
                     "tokenizer is not this model's",
                     o.model_dir, id, cfg.vocab_size);
    if (strata::generate_positions(prompt.size(), g.max_new_tokens) > std::uint64_t(ctx)) {
      // The ways on that there are: fewer new tokens where the prompt leaves room for one, a
      // larger --context where the model takes more.
      std::string ways;
      if (std::int64_t(prompt.size()) <= ctx)
        ways += fmt::format(", or give --max-new-tokens {} or less",
                            ctx - std::int64_t(prompt.size()) + 1);
      if (ctx < limit.positions)
        ways += fmt::format(", or a larger --context, up to the model's {}", limit.positions);
      STRATA_THROW(kInvalidArgument,
                   "the conversation is {} tokens after turn {}, and with --max-new-tokens {} no "
                   "longer fits the {} positions {}: start a new one{}",
                   prompt.size(), turn + 1, g.max_new_tokens, ctx,
                   o.context > 0 ? "of --context" : "the chat holds", ways);
    }
    strata::TokenStreamDecoder text(*tok, /*skip_special_tokens=*/true);
    auto put = [&](const std::string& s) {
      std::fwrite(s.data(), 1, s.size(), out);
      std::fflush(out);
    };
    // Keep the cache when the new prompt extends what it holds (the reply encoded back as it
    // was generated); else run the whole conversation again.
    g.cached_prefix = 0;
    if (g.kv_cache && held.size() < prompt.size() &&
        std::equal(held.begin(), held.end(), prompt.begin()))
      g.cached_prefix = std::int64_t(held.size());
    const strata::GenerateResult r =
        strata::generate(*m.model, *m.weights, prompt, g, [&](std::int32_t id) {
          if (id == *eot_id) return;
          put(id < tok->vocab_size() ? text.push(id)
                                     : text.finish() + "[id " + std::to_string(id) + "]");
        });
    put(text.finish() + "\n");
    held = prompt;  // and every new token but the last, which was never fed
    if (r.tokens.empty())
      held.clear();  // nothing ran: the cache may hold less than the prompt
    else
      held.insert(held.end(), r.tokens.begin(), r.tokens.end() - 1);
    std::vector<std::int32_t> reply_ids = r.tokens;
    if (r.stopped && !reply_ids.empty()) reply_ids.pop_back();  // the end-of-turn / eos token
    // The reply as text, as it printed: the next turn renders it back into the conversation.
    const std::string reply = strata::decode_generated(*tok, reply_ids, true);
    history.push_back({"assistant", reply});
    ++turn;
    if (o.json) {
      const nlohmann::json j = {{"turn", turn},
                                {"prompt_ids", prompt},
                                {"cached_tokens", g.cached_prefix},
                                {"new_tokens", r.tokens},
                                {"reply", reply},
                                {"stopped", r.stopped},
                                {"prompt_s", r.prompt_s},
                                {"decode_s", r.decode_s},
                                {"decode_tokens_per_s", decode_rate(r)}};
      std::printf("%s\n", j.dump().c_str());
      std::fflush(stdout);
    }
  }
  return 0;
}

int run(const Options& o) {
  const fs::path dir(o.model_dir);
  std::error_code ec;
  STRATA_REQUIRE(fs::is_directory(dir, ec),
                 "--model {}: no such folder (give a Hugging Face "
                 "folder: config.json and safetensors, as strata-train --out writes)",
                 o.model_dir);
  STRATA_REQUIRE(o.chat || (o.chat_format.empty() && !o.system_given && o.chat_date.empty()),
                 "--chat-format, --chat-date and --system shape a chat: give --chat too");
  STRATA_REQUIRE(o.chat || o.prompt.empty() != o.prompt_ids.empty(),
                 "give the prompt once: --prompt TEXT (through the folder's tokenizer, or a "
                 "byte-level model's bytes) or --prompt-ids \"ID ID ...\"");
  const strata::ModelConfig cfg = strata::load_model_config((dir / "config.json").string());
  const GenConfig gen = read_generation_config(dir);
  // The folder's tokenizer (tokenizer.json, else tokenizer.model) when there is one (one this
  // tokenizer cannot run: ids only, and --prompt says why); a byte-level model (vocab_size 256 or
  // less, as strata-train trains on bytes) without one reads and prints bytes.
  const fs::path tok_file = strata::Tokenizer::file_in(dir);
  const bool has_tokenizer = !tok_file.empty();
  std::optional<strata::Tokenizer> tok;
  std::string tok_error;
  if (has_tokenizer) {
    try {
      tok = strata::Tokenizer::from_folder(dir);
    } catch (const strata::Error& e) {
      tok_error = e.user_message();
    }
  }
  const std::string tok_why =
      has_tokenizer ? fmt::format("{} cannot be used ({})", tok_file.string(), tok_error)
                    : fmt::format("{} has no tokenizer.json or tokenizer.model (vocab_size {})",
                                  o.model_dir, cfg.vocab_size);
  if (o.chat) return run_chat(o, cfg, gen, tok, tok_why);
  const bool byte_level = cfg.vocab_size <= 256 && !has_tokenizer;

  std::vector<std::int32_t> prompt;
  if (!o.prompt.empty()) {
    if (tok) {
      prompt = tok->encode(o.prompt, /*add_special_tokens=*/true);
      for (std::int32_t id : prompt)
        STRATA_REQUIRE(id < cfg.vocab_size,
                       "--prompt: {} gives id {}, beyond the model's vocab_size {}: "
                       "the tokenizer is not this model's",
                       tok_file.string(), id, cfg.vocab_size);
      STRATA_REQUIRE(!prompt.empty(), "--prompt '{}' encodes to no token: give some text",
                     o.prompt);
    } else {
      STRATA_REQUIRE(byte_level,
                     "--prompt TEXT needs the model's tokenizer, and {}: give the prompt's token "
                     "ids with --prompt-ids \"ID ID ...\"",
                     tok_why);
      for (std::size_t i = 0; i < o.prompt.size(); ++i) {
        const auto c = static_cast<unsigned char>(o.prompt[i]);
        STRATA_REQUIRE(c < cfg.vocab_size,
                       "--prompt: byte {} (0x{:02x}, at {}) is outside the byte-level model's "
                       "vocabulary [0, {}): give text of bytes below {}, or the ids with "
                       "--prompt-ids",
                       int(c), int(c), i, cfg.vocab_size, cfg.vocab_size);
        prompt.push_back(c);
      }
    }
  } else {
    prompt = strata::parse_token_ids(o.prompt_ids, cfg.vocab_size, "--prompt-ids");
  }
  // A byte-level model's continuation prints as bytes when its prompt came as text; ids in, ids
  // out.
  const bool text_out = !o.ids && (tok || (byte_level && !o.prompt.empty()));
  const strata::GenerateOptions g = generate_options(o, gen, cfg.raw, tok);

  // --context first (a --context past the model is its own fault), then what the run needs.
  const strata::ContextLimit limit = strata::context_limit(cfg);
  check_context_flag(o, limit);
  const std::uint64_t need = strata::generate_positions(prompt.size(), o.max_new_tokens);
  STRATA_REQUIRE(o.context == 0 || need <= std::uint64_t(o.context),
                 "--context {} is shorter than the prompt ({} tokens) and --max-new-tokens {} "
                 "need ({})",
                 o.context, prompt.size(), o.max_new_tokens, need);
  STRATA_REQUIRE(need <= std::uint64_t(limit.positions),
                 "the prompt ({} tokens) and --max-new-tokens {} need {} positions; the model "
                 "takes {}: shorten the prompt or lower --max-new-tokens",
                 prompt.size(), o.max_new_tokens, need, limit_text(limit));
  const std::int64_t ctx = o.context > 0 ? o.context : std::int64_t(need);

  LoadedModel m = load_model(o, cfg, ctx);
  if (!o.json) announce(o, cfg, m, g);
  std::FILE* out = o.json ? stderr : stdout;
  auto put = [&](const std::string& text) { std::fwrite(text.data(), 1, text.size(), out); };
  // The prompt first, as the model continues it; the new tokens go on from its text (a Llama 2
  // tokenizer's first new "▁the" is " the" after "The cat", as Hugging Face decodes the sequence).
  const std::string prompt_text =
      !text_out ? std::string()
      : o.prompt.empty() && tok
          ? strata::decode_generated(*tok, prompt, /*skip_special_tokens=*/true)
          : o.prompt;
  put(prompt_text);
  std::fflush(out);
  std::optional<strata::TokenStreamDecoder> stream_text;
  if (text_out && tok)
    stream_text.emplace(*tok, /*skip_special_tokens=*/true, /*continues=*/!prompt_text.empty());
  const strata::GenerateResult r =
      strata::generate(*m.model, *m.weights, prompt, g, [&](std::int32_t id) {
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
  const double tps = decode_rate(r);
  if (o.json) {
    nlohmann::json j = {{"prompt_tokens", prompt.size()},
                        {"new_tokens", r.tokens},
                        {"stopped_on_eos", r.stopped},
                        {"kv_cache", g.kv_cache},
                        {"dtype", std::string(strata::dtype_name(m.dtype))},
                        {"device", std::string(m.dev->name())},
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
                 "vocab_size 256 or less without one: its bytes)");
  app.add_option("--prompt-ids", o.prompt_ids, "the prompt as token ids: \"1 2 3\" or \"1,2,3\"");
  app.add_flag("--chat", o.chat,
               "a conversation: user messages from stdin, a line each (or the one --prompt "
               "TEXT), rendered with the model's chat template; the replies stream to stdout; "
               "/exit or EOF ends");
  app.add_option("--system", o.system, "--chat: the system prompt");
  app.add_option("--chat-format", o.chat_format,
                 "--chat: the layout when the folder has no chat template it recognises: chatml | "
                 "llama3 | llama2 | mistral | none")
      ->check(CLI::IsMember({"chatml", "llama3", "llama2", "mistral", "none"}));
  app.add_option("--chat-date", o.chat_date,
                 "--chat: the \"Today Date\" of a Llama 3.1+ template, e.g. \"02 Dec 2026\" "
                 "(default: the template's own, \"26 Jul 2024\")");
  app.add_option("--max-new-tokens", o.max_new_tokens, "tokens to generate (default 64)")
      ->check(strata::tools::kCount);
  app.add_option("--temperature", o.temperature,
                 "0: greedy; > 0: sample from softmax(logits / T) (default: "
                 "generation_config.json's when it samples, else 0)")
      ->check(strata::tools::kNonNegative);
  app.add_option("--top-p", o.top_p, "nucleus sampling: the most likely tokens up to P (0, 1]")
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            const std::string ok = strata::tools::kPositive(text);
            if (!ok.empty()) return ok;
            return std::stod(text) <= 1 ? std::string() : "must be at most 1, got " + text;
          },
          "(0, 1]"));
  app.add_option("--top-k", o.top_k, "sample among the K most likely tokens (0: all)")
      ->check(strata::tools::kCount);
  app.add_option("--seed", o.seed, "the sampler's seed, 0 to 2^64 - 1 (default 0)")
      ->check(strata::tools::kSeed);
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
  return strata::tools::run_tool(
      "strata-generate", app, argc, argv, strata::tools::ToolRuns::kernels, [&] {
        o.system_given = app.count("--system") > 0;
        STRATA_REQUIRE(
            app.count("--prompt") == 0 || !o.prompt.empty(),
            "--prompt is empty: give the text the model continues{}",
            o.chat ? " (or, with --chat, leave --prompt out and type each message)" : "");
        STRATA_REQUIRE(app.count("--prompt-ids") == 0 || !o.prompt_ids.empty(),
                       "--prompt-ids is empty: give at least one token id");
        return run(o);
      });
}
