// Text generation with strata's transformer: the next-token sampler and the decode loop that
// strata-generate and strata-train --sample-every run.
//
// generate() feeds the prompt through Model::decode (one pass over the prompt fills the key/value
// cache), then one token at a time, each chosen by a Sampler from the last position's logits and
// handed to `on_token` as soon as it is known (streaming). Without the cache (kv_cache false,
// the reference path) every new token runs Model::logits over the whole sequence so far — the
// training forward itself, the sequence padded to the model's seq_len with id 0, which a causal
// model's earlier positions never see.
//
// Example:
//
//   strata::Model model(cfg, *dev, *stream, {.micro_batch = 1, .seq_len = 256, .compute = dt});
//   strata::ResidentWeights w(model, *stream);
//   strata::load_hf_weights(dir, w);
//   strata::GenerateOptions g;  // greedy, 64 new tokens
//   auto r = strata::generate(model, w, prompt_ids, g, [](std::int32_t id) { ... });
#pragma once

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "strata/model.h"
#include "strata/tokenizer.h"

namespace strata {

// How the next token is picked, as Hugging Face's generate() picks it: temperature, then top-k,
// then top-p (nucleus) on the logits; temperature 0 is greedy (the first index of the largest
// logit, do_sample false).
struct SamplingOptions {
  double temperature = 0;  // 0: greedy; else > 0, the logits divided by it
  std::int64_t top_k = 0;  // keep the k most likely tokens (0: all)
  double top_p = 1.0;      // keep the most likely tokens whose probabilities sum to >= top_p
  std::uint64_t seed = 0;  // the sampler's generator (std::mt19937_64): same seed, same text
};

// Throws strata::Error naming the value when an option is out of range (temperature < 0 or not
// finite, top_k < 0, top_p outside (0, 1]).
void check_sampling(const SamplingOptions& o);

class Sampler {
 public:
  explicit Sampler(const SamplingOptions& o);
  // The next token from `logits` [vocab]. Non-finite logits are an error (a diverged model).
  std::int32_t next(const std::vector<float>& logits);

 private:
  SamplingOptions o_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, std::int32_t>> kept_;  // scratch: (probability, id)
};

struct GenerateOptions {
  std::int64_t max_new_tokens = 64;
  bool kv_cache = true;  // false: the full-forward reference path (slow)
  std::vector<std::int32_t>
      stop_ids;  // generation ends after one of these (eos), kept in the output
  SamplingOptions sampling;
  // The model's key/value cache already holds prompt[0, cached_prefix) from an earlier call
  // (Model::decode_length() equals it): the cache is kept and only the rest of the prompt runs
  // (a chat's next turn). 0: the cache is reset and the whole prompt runs. Needs kv_cache and a
  // prompt longer than the prefix.
  std::int64_t cached_prefix = 0;
};

struct GenerateResult {
  std::vector<std::int32_t> tokens;  // the new tokens, prompt not included
  bool stopped = false;              // ended on a stop id (not on max_new_tokens)
  double prompt_s = 0;               // the prompt's pass (to the first new token)
  double decode_s = 0;               // every token after the first
};

// Token ids written as text, "1 2 3" or "1,2,3", each checked against the vocabulary [0, vocab);
// `flag` names where they came from in errors ("--prompt-ids").
std::vector<std::int32_t> parse_token_ids(const std::string& text, std::int64_t vocab,
                                          const std::string& flag);

// The text of generated ids: tokenizer.decode over each run of ids the tokenizer has, and "[id N]"
// for an id beyond it (a model's vocabulary is often padded past its tokenizer's, and an untrained
// row can still be sampled), so a sample never fails on its own output. `continues`: the ids go
// on from text already shown (the prompt), so a decoder such as Llama 2's keeps the first token's
// space ("The cat" + " the", not "The catthe"); a run after an "[id N]" goes on from it.
std::string decode_generated(const Tokenizer& tokenizer, const std::vector<std::int32_t>& ids,
                             bool skip_special_tokens = true, bool continues = false);

// The positions generate() runs through the model for a prompt of `prompt_tokens` and
// `max_new_tokens` (>= 0) new ones: prompt + max(max_new_tokens, 1) - 1 (the last new token is
// never fed). Unsigned 64 bits hold it for every max_new_tokens up to 2^63 - 1, so a huge request
// is a large number to refuse, never a wrapped one that passes a check.
std::uint64_t generate_positions(std::size_t prompt_tokens, std::int64_t max_new_tokens);

// The most positions a model of `cfg` can generate over: config.json's max_position_embeddings
// (GPT-2's n_positions), or its sliding_window where that is smaller and binds (Mistral, and Qwen2
// with use_sliding_window true), since strata's attention is full causal and a Model refuses a
// seq_len past the window. `key` names the config.json key that sets it, for messages.
struct ContextLimit {
  std::int64_t positions = 0;
  std::string key;
};
ContextLimit context_limit(const ModelConfig& cfg);

// `model` needs a seq_len of at least generate_positions(prompt, max_new_tokens) (an error says so
// before anything runs), and without the cache a micro_batch of 1 (the model's own, as training
// built it, serves with the cache). The cache is reset first (kept with
// GenerateOptions::cached_prefix) and left holding the sequence: the prompt and every new token but
// the last.
GenerateResult generate(Model& model, UnitProvider& weights,
                        const std::vector<std::int32_t>& prompt, const GenerateOptions& options,
                        const std::function<void(std::int32_t)>& on_token = {});

}  // namespace strata
