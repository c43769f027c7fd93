// A user's own text in: corpus files read as documents, tokenized with the model's tokenizer, and
// the prepared training file (docs/prepared-data.md) that holds them for the loader.
//
// Inputs (each file one of):
//   - plain text: the whole file is one document, or, with `separator`, the pieces between
//     separators are (empty pieces are skipped);
//   - JSON lines (`.jsonl`, `.ndjson`, `.json`): one record per line (blank lines skipped); a
//     record with a string
//     field `text_field` (default "text") is one document; a record with `messages`,
//     `conversations` or `instruction` is a chat record, rendered by CorpusOptions::chat
//     (use_chat_template: the model folder's chat template, strata/chat.h); without one a chat
//     record is an error naming --chat-format.
// Text must be well-formed UTF-8: an error names the file and line otherwise.
//
// A text document's tokens are tokenizer.encode(text) (with the BOS its template adds) followed
// by the tokenizer's EOS, so the model learns to stop. A chat document is the renderer's tokens
// as they are (its template ends each turn with its own token).
//
// What counts in the loss is per token: counted[i] = 1 means "the prediction of tokens[i] from
// tokens[0..i) counts": the target at position i - 1 is tokens[i] and it is trained on.
// counted[0] is always 0 (nothing in a document predicts its first token). Text documents count
// every token after the first, the EOS included; a chat document counts what its renderer says
// (the assistant's tokens).
//
// The prepared file (magic "STRATAPD") holds the tokens, the counted mask and the documents'
// starts under a header with the tokenizer's hash; write_prepared writes it atomically
// (tmp + rename); read_prepared_header / PreparedFile validate every field with errors naming the
// file and the fix.
//
// Example:
//
//   const std::string dir = "models/Llama-3.2-1B";
//   auto tok = strata::Tokenizer::from_folder(dir);
//   strata::CorpusOptions c;  // all cores
//   const std::string hash = strata::tokenizer_hash(dir, tok);
//   strata::PrepSummary s = strata::prepare_corpus(tok, hash, {"docs.jsonl"}, "docs.prep", c);
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "strata/tokenizer.h"

namespace strata {

struct Document {
  std::vector<std::int32_t> tokens;
  // counted[i] = 1: the target tokens[i] (predicted at position i - 1) counts in the loss;
  // counted[0] = 0. Same length as tokens.
  std::vector<std::uint8_t> counted;
};

// Renders one chat record (an object with messages / conversations / instruction) as a document.
// `where` is "file:line" for messages.
using ChatRecordEncoder = std::function<Document(const Tokenizer&, const nlohmann::json& record,
                                                 const std::string& where)>;

struct PrepProgress {
  std::uint64_t bytes_done = 0, bytes_total = 0;  // of the inputs
  std::uint64_t documents = 0, tokens = 0;
};

struct CorpusOptions {
  std::string text_field = "text";  // .jsonl: the field that holds a document's text
  // The user named text_field (--text-field): a record holding it as a string is a text document
  // even when it also has chat keys (tatsu-lab/alpaca's rows: instruction, input, output, text);
  // otherwise those keys make it a chat record.
  bool text_field_named = false;
  std::optional<std::string> separator;   // plain text: split each file on this (none: a file is
                                          // one document)
  int threads = 0;                        // tokenizing threads; 0: all cores
  std::uint64_t max_document_tokens = 0;  // > 0: longer documents are cut (counted as truncated)
  ChatRecordEncoder chat;                 // empty: encode_chat_record's default
  // What `chat` renders with (use_chat_template sets both): part of the prepared file's source
  // description, so that a cache of a corpus is not reused under another template.
  std::string chat_template;
  std::function<void(const PrepProgress&)> progress;  // after each chunk (optional)
};

// Chat records rendered with the model folder `dir`'s chat template (chat_template_from_folder),
// or with `format`'s plain layout when it is not empty (--chat-format: chatml, llama3, llama2,
// mistral, none), with render_options_for(the tokenizer), and encoded with the assistant's tokens
// counted (strata/chat.h: encode_chat). Sets o.chat and o.chat_template. A folder whose template
// is missing or not recognised fails at its first chat record, with the error naming
// --chat-format; a corpus of text records never needs one.
void use_chat_template(CorpusOptions& o, const std::filesystem::path& dir,
                       const std::string& format = {});

// The identity of a tokenizer for the prepared file: XXH3-128 of the bytes of the file it was
// read from (`dir`/tokenizer.json, else tokenizer.model: Tokenizer::file_in) and the special-token
// settings (bos, eos, pad, whether BOS is added; for tokenizer.model also tokenizer_config.json's
// add_eos_token and legacy where they are not the defaults), as 32 hex digits.
std::string tokenizer_hash(const std::filesystem::path& dir, const Tokenizer& tokenizer);

// The documents of one input file, in order (no parallelism: for tests and small inputs).
std::vector<Document> read_corpus_file(const Tokenizer& tokenizer, const std::string& path,
                                       const CorpusOptions& options = {});

// The prepared file's header (docs/prepared-data.md, byte by byte).
inline constexpr char kPreparedMagic[8] = {'S', 'T', 'R', 'A', 'T', 'A', 'P', 'D'};
inline constexpr std::uint32_t kPreparedVersion = 1;
inline constexpr std::size_t kPreparedHeaderBytes = 128;

struct PreparedHeader {
  std::uint32_t version = kPreparedVersion;
  std::uint32_t token_bytes = 2;  // 2 (vocab <= 65536) or 4
  std::uint64_t vocab_size = 0;   // the tokenizer's
  std::array<std::uint8_t, 16> tokenizer_hash{};
  std::uint64_t documents = 0, tokens = 0, counted_tokens = 0, truncated_documents = 0;
  std::uint64_t source_bytes = 0;  // length of the source description (JSON text)
  std::uint64_t tokens_offset = 0, mask_offset = 0, starts_offset = 0, file_bytes = 0;
  std::string source;  // the source description: {"inputs": [{path, bytes, mtime_ns}], ...}

  std::string tokenizer_hash_hex() const;
};

// True when the file at `path` starts with kPreparedMagic (false when it cannot be read).
bool is_prepared_file(const std::string& path);

// Whether `path` names JSON lines by its suffix: .jsonl, .ndjson, or .json (Hugging Face's
// Dataset.to_json writes JSON lines under that name), in any case. A .json file that holds one
// JSON array (Alpaca's alpaca_data.json) is refused when read, with the command that turns it into
// JSON lines.
bool is_json_lines_file(const std::string& path);

// Whether `path` names a text corpus: .txt, in any case.
bool is_text_corpus_file(const std::string& path);

// Whether `path` names a corpus strata tokenizes itself: JSON lines or text (the two above).
bool is_corpus_file(const std::string& path);

// A hash of a file's first and last MiB (all of a smaller one) and its `size`, 16 hex digits; ""
// where it cannot be read. Tells a file's bytes from another's of the same size and time without
// reading it all (`cp -p`, rsync -a and tar keep both): the prepared-corpus cache's inputs, the
// data files a checkpoint records (data_identity).
std::string file_sample_hash(const std::string& path, std::uint64_t size);

// Reads and validates the header (magic, version, sizes, offsets against the file's size).
PreparedHeader read_prepared_header(const std::string& path);

// A prepared file mapped for reading; the constructor validates the header, the documents' starts
// (0 first, increasing, below tokens) and the mask's count against the header's counted_tokens.
class PreparedFile {
 public:
  explicit PreparedFile(const std::string& path);
  ~PreparedFile();
  PreparedFile(const PreparedFile&) = delete;
  PreparedFile& operator=(const PreparedFile&) = delete;

  const PreparedHeader& header() const { return header_; }
  const std::string& path() const { return path_; }
  std::int64_t tokens() const { return std::int64_t(header_.tokens); }
  std::int64_t documents() const { return std::int64_t(header_.documents); }
  std::int32_t token(std::int64_t i) const;
  bool counted(std::int64_t i) const {
    return (base_[header_.mask_offset + std::size_t(i) / 8] >> (i % 8)) & 1;
  }
  std::int64_t doc_start(std::int64_t d) const;  // d in [0, documents]: documents gives tokens()

 private:
  std::string path_;
  PreparedHeader header_;
  const std::uint8_t* base_ = nullptr;
  std::size_t size_ = 0;
};

struct PrepSummary {
  std::uint64_t documents = 0, tokens = 0, counted_tokens = 0, truncated_documents = 0;
  std::uint64_t input_bytes = 0;
  int threads = 0;
  double seconds = 0;
  std::string tokenizer_hash;
};

// The source description of `inputs` under `options` (paths made absolute, sizes, mtimes in ns,
// text_field, separator, max_document_tokens): what a cache compares to decide reuse.
nlohmann::json describe_sources(const std::vector<std::string>& inputs,
                                const CorpusOptions& options);

// Reads `inputs`, tokenizes their documents on options.threads threads (the output does not depend
// on the number: documents keep their input order) and writes the prepared file `out`
// atomically. Throws strata::Error naming the file and line of bad input.
PrepSummary prepare_corpus(const Tokenizer& tokenizer, const std::string& tokenizer_hash_hex,
                           const std::vector<std::string>& inputs, const std::string& out,
                           const CorpusOptions& options);

// Writes documents as a prepared file (atomically) with prepare_corpus's writer: for tests and
// programs that make their documents themselves. The header records `truncated_documents` (the
// documents are taken as they are).
void write_prepared(const std::string& out, std::uint64_t vocab_size,
                    const std::string& tokenizer_hash_hex, const std::vector<Document>& docs,
                    const std::string& source_json = "{}", std::uint64_t truncated_documents = 0);

}  // namespace strata
