// The sampler and the decode loop (strata/generate.h). Everything here runs on the host between
// Model calls: the logits come back as host vectors, one row per new token.
#include "strata/generate.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <string>

#include "strata/error.h"

namespace strata {

void check_sampling(const SamplingOptions& o) {
  STRATA_REQUIRE(std::isfinite(o.temperature) && o.temperature >= 0,
                 "sampling: temperature must be a finite number >= 0 (0: greedy), got {}",
                 o.temperature);
  STRATA_REQUIRE(o.top_k >= 0, "sampling: top_k must be >= 0 (0: every token), got {}", o.top_k);
  STRATA_REQUIRE(o.top_p > 0 && o.top_p <= 1, "sampling: top_p must be in (0, 1], got {}", o.top_p);
}

Sampler::Sampler(const SamplingOptions& o) : o_(o), rng_(o.seed) { check_sampling(o); }

std::int32_t Sampler::next(const std::vector<float>& logits) {
  STRATA_REQUIRE(!logits.empty(), "Sampler::next: no logits");
  for (std::size_t i = 0; i < logits.size(); ++i)
    STRATA_REQUIRE(std::isfinite(logits[i]),
                   "the model's logit for token {} is {}: its weights or activations are not "
                   "finite (a diverged or damaged model)",
                   i, logits[i]);
  if (o_.temperature == 0)
    return static_cast<std::int32_t>(std::max_element(logits.begin(), logits.end()) -
                                     logits.begin());
  // Most likely first; equal logits by id, so the order (and the draw) is the same everywhere.
  kept_.resize(logits.size());
  for (std::size_t i = 0; i < logits.size(); ++i)
    kept_[i] = {logits[i], static_cast<std::int32_t>(i)};
  auto before = [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  std::size_t k = kept_.size();
  if (o_.top_k > 0 && std::size_t(o_.top_k) < k) {
    k = std::size_t(o_.top_k);
    std::partial_sort(kept_.begin(), kept_.begin() + std::ptrdiff_t(k), kept_.end(), before);
    kept_.resize(k);
  } else {
    std::sort(kept_.begin(), kept_.end(), before);
  }
  // Softmax of logits / temperature over the kept tokens, in double.
  const double mx = kept_[0].first / o_.temperature;
  std::vector<double> p(k);
  double sum = 0;
  for (std::size_t i = 0; i < k; ++i) sum += p[i] = std::exp(kept_[i].first / o_.temperature - mx);
  // Nucleus: the shortest prefix whose probability reaches top_p (never empty).
  std::size_t n = k;
  if (o_.top_p < 1) {
    double cum = 0;
    for (std::size_t i = 0; i < k; ++i) {
      cum += p[i] / sum;
      if (cum >= o_.top_p) {
        n = i + 1;
        break;
      }
    }
  }
  double total = 0;
  for (std::size_t i = 0; i < n; ++i) total += p[i];
  // A uniform in [0, total) from the top 53 bits (std's distributions differ between libraries).
  const double u = double(rng_() >> 11) * 0x1.0p-53 * total;
  double acc = 0;
  for (std::size_t i = 0; i < n; ++i) {
    acc += p[i];
    if (u < acc) return kept_[i].second;
  }
  return kept_[n - 1].second;
}

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// The reference path: the training forward over the sequence padded to seq_len (causal: the
// padding is never seen by the positions before it), the last real position's row.
std::vector<float> full_forward_last(Model& model, UnitProvider& w,
                                     const std::vector<std::int32_t>& seq) {
  const std::size_t T = static_cast<std::size_t>(model.options().seq_len);
  const std::size_t V = static_cast<std::size_t>(model.config().vocab_size);
  STRATA_REQUIRE(!seq.empty() && seq.size() <= T,
                 "generate: a sequence of {} tokens does not fit the model's seq_len {}",
                 seq.size(), T);
  std::vector<std::int32_t> padded(seq);
  padded.resize(T, 0);
  const std::vector<float> all = model.logits(padded, w);
  STRATA_REQUIRE(all.size() >= seq.size() * V,
                 "generate: the model gave {} logits, fewer than the {} x {} of the sequence",
                 all.size(), seq.size(), V);
  const auto row = all.begin() + std::ptrdiff_t((seq.size() - 1) * V);
  return std::vector<float>(row, row + std::ptrdiff_t(V));
}

}  // namespace

std::vector<std::int32_t> parse_token_ids(const std::string& text, std::int64_t vocab,
                                          const std::string& flag) {
  std::vector<std::int32_t> ids;
  std::string tok;
  auto flush = [&] {
    if (tok.empty()) return;
    long long v = 0;
    std::size_t used = 0;
    try {
      v = std::stoll(tok, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    STRATA_REQUIRE(used == tok.size(),
                   "{}: '{}' is not a token id (give whole numbers separated by spaces or commas)",
                   flag, tok);
    STRATA_REQUIRE(v >= 0 && v < vocab, "{}: {} is outside the model's vocabulary [0, {})", flag, v,
                   vocab);
    ids.push_back(static_cast<std::int32_t>(v));
    tok.clear();
  };
  for (char c : text) {
    if (c == ' ' || c == ',' || c == '\t' || c == '\n')
      flush();
    else
      tok += c;
  }
  flush();
  STRATA_REQUIRE(!ids.empty(), "{} is empty: give at least one token id", flag);
  return ids;
}

std::string decode_generated(const Tokenizer& tokenizer, const std::vector<std::int32_t>& ids,
                             bool skip_special_tokens, bool continues) {
  std::string out;
  std::size_t run = 0;  // the start of the run of ids the tokenizer has
  for (std::size_t i = 0; i <= ids.size(); ++i) {
    if (i < ids.size() && ids[i] >= 0 && ids[i] < tokenizer.vocab_size()) continue;
    out += tokenizer.decode(std::span<const std::int32_t>(ids.data() + run, i - run),
                            skip_special_tokens, continues || !out.empty());
    if (i < ids.size()) out += "[id " + std::to_string(ids[i]) + "]";
    run = i + 1;
  }
  return out;
}

std::uint64_t generate_positions(std::size_t prompt_tokens, std::int64_t max_new_tokens) {
  return std::uint64_t(prompt_tokens) + std::uint64_t(std::max<std::int64_t>(max_new_tokens, 1)) -
         1;
}

ContextLimit context_limit(const ModelConfig& cfg) {
  ContextLimit l{cfg.max_positions,
                 cfg.arch == ModelArch::kGpt2 ? "n_positions" : "max_position_embeddings"};
  // The rule Model's constructor applies.
  if (const std::int64_t w = binding_sliding_window(cfg); w > 0 && w < l.positions)
    l = {w, "sliding_window"};
  return l;
}

GenerateResult generate(Model& model, UnitProvider& weights,
                        const std::vector<std::int32_t>& prompt, const GenerateOptions& o,
                        const std::function<void(std::int32_t)>& on_token) {
  STRATA_REQUIRE(!prompt.empty(), "generate: the prompt is empty: give at least one token");
  STRATA_REQUIRE(o.max_new_tokens >= 0, "generate: max_new_tokens must be >= 0, got {}",
                 o.max_new_tokens);
  STRATA_REQUIRE(o.kv_cache || model.options().micro_batch == 1,
                 "generate: without the key/value cache the model must be built with micro_batch "
                 "1 (one sequence), got {}",
                 model.options().micro_batch);
  // Every position but the last new token's runs through the model.
  const std::uint64_t positions = generate_positions(prompt.size(), o.max_new_tokens);
  STRATA_REQUIRE(positions <= std::uint64_t(model.options().seq_len),
                 "generate: a prompt of {} tokens and {} new ones need a context of {} positions; "
                 "the model was built with seq_len {}",
                 prompt.size(), o.max_new_tokens, positions, model.options().seq_len);
  Sampler sampler(o.sampling);
  GenerateResult r;
  if (o.cached_prefix > 0) {
    STRATA_REQUIRE(o.kv_cache && o.cached_prefix < std::int64_t(prompt.size()),
                   "generate: cached_prefix {} needs the key/value cache and a prompt longer than "
                   "it (the prompt has {} tokens)",
                   o.cached_prefix, prompt.size());
    STRATA_REQUIRE(model.decode_length() == o.cached_prefix,
                   "generate: cached_prefix {} but the model's cache holds {} positions",
                   o.cached_prefix, model.decode_length());
  } else {
    model.reset_decode();
  }
  if (o.max_new_tokens == 0) return r;
  std::vector<std::int32_t> seq(prompt);
  const auto t0 = Clock::now();
  std::vector<float> logits =
      o.kv_cache
          ? model.decode(std::vector<std::int32_t>(prompt.begin() + o.cached_prefix, prompt.end()),
                         weights)
          : full_forward_last(model, weights, seq);
  auto t1 = t0;
  for (std::int64_t i = 0;; ++i) {
    const std::int32_t tok = sampler.next(logits);
    if (i == 0) {
      r.prompt_s = since(t0);
      t1 = Clock::now();
    }
    r.tokens.push_back(tok);
    seq.push_back(tok);
    if (on_token) on_token(tok);
    if (std::find(o.stop_ids.begin(), o.stop_ids.end(), tok) != o.stop_ids.end()) {
      r.stopped = true;
      break;
    }
    if (i + 1 == o.max_new_tokens) break;
    logits = o.kv_cache ? model.decode({tok}, weights) : full_forward_last(model, weights, seq);
  }
  r.decode_s = since(t1);
  return r;
}

}  // namespace strata
