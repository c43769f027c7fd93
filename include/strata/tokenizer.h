// Text <-> token ids with a Hugging Face model folder's own tokenizer, in C++.
//
// Tokenizer::from_folder reads tokenizer.json (the `tokenizers` library's serialised pipeline)
// and, when present, tokenizer_config.json (bos/eos/pad tokens, add_bos_token). Encoding runs
// the pipeline the file describes, in Hugging Face's order:
//
//   added tokens (special ones included) are cut out of the raw text first, leftmost-longest;
//   each remaining span is normalized (NFC, Prepend, Replace, Sequence), pre-tokenized (Split
//   with the file's regex, run by PCRE2 with Unicode classes; ByteLevel's byte -> character
//   map), and each piece is merged by the BPE model (merges by rank, byte_fallback, unk);
//   the post-processor adds the template's tokens (BOS) when add_special_tokens is true.
//
// Covered: byte-level BPE (GPT-2, Llama 3, Qwen2/3) and BPE with byte fallback behind the
// Llama 2 / Mistral normalizer (Prepend "▁", Replace " " -> "▁") or the Metaspace pre-tokenizer,
// with the Replace / ByteFallback / Fuse / Strip / Metaspace decoders. Anything else in a file
// (WordPiece, Unigram, a Whitespace pre-tokenizer) is refused by name when the folder is read,
// never guessed at. A folder with a SentencePiece tokenizer.model and no tokenizer.json is run by
// libsentencepiece (BPE or Unigram, its normalizer and byte fallback), behind the same added
// tokens, template and decoders.
//
// Decoding: decode() gives text (bytes that do not form UTF-8 become U+FFFD, as Hugging Face's
// decoders do). A byte-level token may hold part of a character: for streaming, token_bytes()
// gives one token's raw bytes and TokenStreamDecoder hands out text only once a character is
// whole.
//
// A Tokenizer is immutable after construction and safe to share between threads; copies share
// the tables.
//
// Example:
//
//   auto tok = strata::Tokenizer::from_folder("models/Llama-3.2-1B");
//   std::vector<std::int32_t> ids = tok.encode("Hello world");      // with the template's BOS
//   std::string text = tok.decode(ids, /*skip_special_tokens=*/true);
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace strata {

class Tokenizer {
 public:
  // Reads `dir`/tokenizer.json, or where there is none `dir`/tokenizer.model (SentencePiece),
  // and `dir`/tokenizer_config.json (optional). Throws strata::Error naming the file and the
  // component when neither is there, or the file is malformed or describes a pipeline this
  // tokenizer does not implement.
  static Tokenizer from_folder(const std::filesystem::path& dir);
  // The file from_folder reads in `dir`: its tokenizer.json, else its tokenizer.model; empty
  // when there is neither.
  static std::filesystem::path file_in(const std::filesystem::path& dir);
  // The same from the files' text; `config_json` may be empty. `origin` names the source in
  // error messages.
  static Tokenizer from_json(std::string_view tokenizer_json, std::string_view config_json = {},
                             std::string origin = "tokenizer.json");
  // A SentencePiece model (the bytes of a tokenizer.model) run by libsentencepiece, with
  // tokenizer_config.json's text (may be empty): its control symbols and unk (and the config's
  // added_tokens_decoder) are special tokens matched in text; BOS first unless add_bos_token is
  // false, EOS last with add_eos_token; with legacy false a span after a special token gets no
  // "▁" put first, as Hugging Face's LlamaTokenizer does.
  static Tokenizer from_sentencepiece(std::string_view model, std::string_view config_json = {},
                                      std::string origin = "tokenizer.model");

  // Token ids of `text` (UTF-8). With `add_special_tokens` the post-processor's template adds its
  // tokens (Llama 2: BOS first); added tokens written in the text are always matched, as Hugging
  // Face does. Throws when `text` is not valid UTF-8.
  std::vector<std::int32_t> encode(std::string_view text, bool add_special_tokens = true) const;
  // Text of `ids`; every id must be below vocab_size(). Special tokens are left out with
  // `skip_special_tokens`. With `continues` the ids go on from text already shown (a prompt), so
  // their first token is not the text's first: a decoder such as Llama 2's keeps its space.
  std::string decode(std::span<const std::int32_t> ids, bool skip_special_tokens = false,
                     bool continues = false) const;
  // The raw bytes one token stands for at position `first` (true: the first token of a text,
  // where a decoder such as Llama 2's strips the prepended space). May be part of a UTF-8
  // character (byte-level and byte-fallback tokens).
  std::string token_bytes(std::int32_t id, bool first = false) const;

  // One past the largest id (the model's vocabulary and the added tokens).
  std::int32_t vocab_size() const;
  // The token's string as tokenizer.json spells it ("Ġworld", "▁the", "<|eot_id|>"); throws for
  // an id out of range.
  const std::string& id_to_token(std::int32_t id) const;
  std::optional<std::int32_t> token_to_id(std::string_view token) const;
  bool is_special(std::int32_t id) const;

  // From tokenizer_config.json (a token named there but absent from the vocabulary is an error
  // when the folder is read); nullopt where the file names none.
  std::optional<std::int32_t> bos_id() const;
  std::optional<std::int32_t> eos_id() const;
  std::optional<std::int32_t> pad_id() const;
  // Whether encode(text, true) puts a BOS first (the post-processor's template says so).
  bool adds_bos() const;

 private:
  struct Impl;
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

// The byte at which `text` stops being well-formed UTF-8 (what Tokenizer::encode refuses), or
// std::string_view::npos when it is well-formed: a chat checks each message as it is read.
std::size_t first_invalid_utf8(std::string_view text);

// Token-by-token decoding for streaming output: push() returns the text a token completes
// (possibly empty while a character's bytes are still arriving), finish() what is left (an
// incomplete character as U+FFFD). The concatenation equals tokenizer.decode(ids) for valid text
// (with `continues`, decode(ids, skip, true): the stream goes on from text already shown).
class TokenStreamDecoder {
 public:
  explicit TokenStreamDecoder(const Tokenizer& tokenizer, bool skip_special_tokens = false,
                              bool continues = false)
      : tok_(&tokenizer), skip_special_(skip_special_tokens), first_(!continues) {}
  std::string push(std::int32_t id);
  std::string finish();

 private:
  const Tokenizer* tok_;
  bool skip_special_;
  bool first_;
  std::string pending_;
};

}  // namespace strata
