// Corpus files -> documents -> the prepared training file (strata/corpus.h).
//
// Owns: reading text / JSON lines inputs (UTF-8 checked line by line), turning each record into a
// Document (the tokenizer for text, the chat encoder for chat records), and the prepared file's
// writer and reader. Invariants: the output depends only on the inputs, the tokenizer and the
// options, never on the number of threads (documents are read in order, tokenized in parallel
// into slots of their own and written in order); the file appears at its path only complete
// (written to a temporary beside it, fsync'd, renamed). It never guesses: an input it cannot read
// as documents is an error naming the file, the line and the fix.
#include "strata/corpus.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <bit>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <exception>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string_view>
#include <thread>

#include "core/file_kind.h"
#include "core/interrupt_files.h"
#include "core/process.h"
#include "core/utf8.h"
#include "core/write_fd.h"
#include "strata/chat.h"
#include "strata/error.h"
#include "strata/json_config.h"
#include "strata/log.h"
#include "strata/paths.h"
#include "text/mapped_file.h"

namespace strata {

namespace fs = std::filesystem;
using Json = nlohmann::json;

namespace {

std::string slurp(const std::string& path, const char* what) {
  std::ifstream f(path, std::ios::binary);
  if (!f) STRATA_THROW(kIo, "{} {} cannot be read: {}", what, path, std::strerror(errno));
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// The 1-based line of byte `at` in `s`.
std::size_t line_of(std::string_view s, std::size_t at) {
  return 1 + std::size_t(std::count(s.begin(), s.begin() + std::ptrdiff_t(at), '\n'));
}

// Throws naming file:line and the byte when `s` (starting at line `first_line` of `path`) is not
// well-formed UTF-8.
void require_utf8(std::string_view s, const std::string& path, std::size_t first_line) {
  const std::size_t i = utf8::first_invalid(s);
  if (i == std::string_view::npos) return;
  const std::size_t nl = i == 0 ? std::string_view::npos : s.rfind('\n', i - 1);
  const std::size_t column = i - (nl == std::string_view::npos ? 0 : nl + 1) + 1;
  STRATA_THROW(kInvalidArgument,
               "{}:{}: byte 0x{:02x} (column {}) is not UTF-8 text: the corpus must be UTF-8 "
               "(convert it first, e.g. iconv -f latin1 -t utf-8)",
               path, first_line + line_of(s, i) - 1, static_cast<unsigned char>(s[i]), column);
}

// One document before tokenizing: a text document, or a .jsonl line not yet parsed (parsing is
// part of the parallel work).
struct RawDoc {
  std::string text;  // the document's text, or the JSON line
  bool json_line = false;
  std::string where;  // file, or file:line
};

// The text document's tokens: encode (its BOS) + EOS; every token after the first counts.
Document encode_text(const Tokenizer& tok, std::string_view text, const std::string& where) {
  Document d;
  try {
    d.tokens = tok.encode(text, /*add_special_tokens=*/true);
  } catch (const Error& e) {
    detail::throw_error(e.kind(), __FILE__, __LINE__, "encode",
                        fmt::format("{}: {}", where, e.message()));
  }
  const std::optional<std::int32_t> eos = tok.eos_id();
  STRATA_REQUIRE(eos.has_value(),
                 "{}: the tokenizer names no EOS token (tokenizer_config.json's eos_token), which "
                 "ends every document so the model learns to stop: add eos_token to the model "
                 "folder's tokenizer_config.json",
                 where);
  // Once: a tokenizer whose template ends with EOS (a TemplateProcessing suffix, add_eos_token)
  // has put it there already.
  if (d.tokens.empty() || d.tokens.back() != *eos) d.tokens.push_back(*eos);
  d.counted.assign(d.tokens.size(), 1);
  d.counted[0] = 0;
  return d;
}

}  // namespace

// Without a template (CorpusOptions::chat not set): never a guess at one.
Document encode_chat_record(const Tokenizer& /*tokenizer*/, const Json& /*record*/,
                            const std::string& where) {
  STRATA_THROW(kInvalidArgument,
               "{}: a chat record (messages / conversations / instruction) is rendered with the "
               "model's chat template, and none was given: prepare the corpus with the model "
               "folder (--model DIR) or name the layout with --chat-format "
               "chatml|llama3|llama2|mistral|none",
               where);
}

void use_chat_template(CorpusOptions& o, const fs::path& dir, const std::string& format) {
  // Read now (the description goes into the source record), but an error only at the first chat
  // record: a corpus of text records needs no template.
  struct Resolved {
    std::optional<ChatTemplate> t;
    std::string error;
  };
  auto r = std::make_shared<Resolved>();
  if (!format.empty()) {
    r->t = chat_template_for(parse_chat_format(format));  // a wrong name is an error at once
  } else {
    try {
      r->t = chat_template_from_folder(dir);
    } catch (const Error& e) {
      r->error = e.message();  // (said mid-sentence: without its kind)
    }
  }
  Json id;
  if (r->t) {
    const ChatTemplate& t = *r->t;
    id = {{"format", chat_format_name(t.format)},
          {"default_system", t.default_system},
          {"qwen3_thinking", t.qwen3_thinking},
          {"space_after_eos", t.space_after_eos},
          {"always_generation_prompt", t.always_generation_prompt},
          {"knowledge_cutoff", t.knowledge_cutoff},
          {"default_date", t.default_date}};
  } else {
    id = {{"error", r->error}};
  }
  o.chat_template = id.dump();
  o.chat = [r](const Tokenizer& tok, const Json& record, const std::string& where) {
    STRATA_REQUIRE(r->t, "{}: a chat record is rendered with the model's chat template: {}", where,
                   r->error);
    const std::vector<ChatMessage> msgs = parse_chat_record(record, ChatUse::kTraining, where);
    EncodedChat e = encode_chat(tok, *r->t, msgs, render_options_for(tok));
    Document d;
    d.tokens = std::move(e.tokens);
    d.counted = std::move(e.counted);
    return d;
  };
}

namespace {

// Records of one .jsonl file (or documents of one text file) as RawDocs, calling `emit` for each
// in order. Text files are read whole; JSON lines line by line.
template <class Emit>
void read_raw(const std::string& path, const CorpusOptions& o, Emit&& emit) {
  if (const std::string kind = foreign_file_kind_of(path); !kind.empty())
    STRATA_THROW(kInvalidArgument, "{} {}", path, kind);
  if (!is_json_lines_file(path)) {
    std::string s = slurp(path, "corpus file");
    if (s.starts_with("\xEF\xBB\xBF")) s.erase(0, 3);  // a UTF-8 BOM marks the file, not its text
    require_utf8(s, path, 1);
    if (!o.separator) {
      if (!s.empty()) emit(RawDoc{std::move(s), false, path});
      return;
    }
    const std::string& sep = *o.separator;
    STRATA_REQUIRE(!sep.empty(), "--separator: give a non-empty string to split on");
    // A file with Windows line ends: a separator of line ends ("\n\n") also matches them as
    // "\r\n" (Python's text mode, Hugging Face's text loader, reads them as "\n").
    std::string crlf;
    if (sep.find('\n') != std::string::npos && s.find("\r\n") != std::string::npos)
      for (char c : sep) crlf += c == '\n' ? std::string("\r\n") : std::string(1, c);
    // The line of each piece's start, counted as the pieces go (not from the file's start).
    std::size_t at = 0, line = 1, counted_to = 0, found = 0;
    // The next match of each form, searched again only once passed (a form that never occurs is
    // searched for once, not once a piece).
    std::size_t next_sep = s.find(sep), next_crlf = crlf.empty() ? crlf.npos : s.find(crlf);
    while (at <= s.size()) {
      if (next_sep < at) next_sep = s.find(sep, at);  // (npos is never below `at`)
      if (next_crlf < at) next_crlf = s.find(crlf, at);
      std::size_t end = next_sep, len = sep.size();
      if (next_crlf < end) end = next_crlf, len = crlf.size();
      if (end == std::string::npos)
        end = s.size();
      else
        ++found;
      line += line_of(std::string_view(s).substr(counted_to, at - counted_to), at - counted_to) - 1;
      counted_to = at;
      if (end > at) emit(RawDoc{s.substr(at, end - at), false, fmt::format("{}:{}", path, line)});
      at = end + len;
    }
    if (found == 0 && !s.empty())
      log::warn("{}: --separator {} does not occur in it: the whole file is one document", path,
                Json(sep).dump(-1, ' ', false, Json::error_handler_t::replace));
    return;
  }
  std::ifstream f(path, std::ios::binary);
  if (!f) STRATA_THROW(kIo, "corpus file {} cannot be read: {}", path, std::strerror(errno));
  {  // One JSON array of records (json.dump(records) or Alpaca's alpaca_data.json) is no lines.
    char c = 0;
    while (f.get(c) && std::string_view(" \t\r\n\xEF\xBB\xBF").find(c) != std::string_view::npos) {
    }
    STRATA_REQUIRE(c != '[' || !f,
                   "{}: one JSON array of records, not JSON lines (one record a line): write it "
                   "as JSON lines, e.g. jq -c '.[]' '{}' > records.jsonl",
                   path, path);
    f.clear();
    f.seekg(0);
  }
  std::string line;
  std::size_t n = 0;
  while (std::getline(f, line)) {
    ++n;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    emit(RawDoc{std::move(line), true, fmt::format("{}:{}", path, n)});
    line.clear();
  }
}

// A .jsonl line as a text document (its text field) or a chat record.
struct Record {
  std::string text;
  Json chat;  // null for a text record
};

Record parse_record(const RawDoc& r, const CorpusOptions& o) {
  // where is "file:line": the UTF-8 check names the line.
  const std::size_t colon = r.where.rfind(':');
  require_utf8(r.text, r.where.substr(0, colon), std::stoul(r.where.substr(colon + 1)));
  STRATA_REQUIRE(!config::nested_too_deep(r.text),
                 "{}: a record that nests arrays and objects more than {} deep: no chat or text "
                 "record does; the line is damaged or not a record",
                 r.where, config::kMaxJsonDepth);
  Json j;
  try {
    j = Json::parse(r.text);
  } catch (const Json::exception& e) {
    STRATA_THROW(kInvalidArgument,
                 "{}: not a JSON record ({}): a .jsonl file holds one JSON object per line (.json "
                 "and .ndjson are read as JSON lines too: name a file .txt to train on it as text)",
                 r.where, e.what());
  }
  STRATA_REQUIRE(j.is_object(), "{}: a {} where a JSON object (one record per line) belongs",
                 r.where, j.type_name());
  const bool named_text =
      o.text_field_named && j.contains(o.text_field) && j[o.text_field].is_string();
  if (!named_text &&
      (j.contains("messages") || j.contains("conversations") || j.contains("instruction")))
    return Record{{}, std::move(j)};
  const auto it = j.find(o.text_field);
  if (it == j.end()) {
    std::string fields;
    for (const auto& [k, v] : j.items()) fields += (fields.empty() ? "" : ", ") + k;
    STRATA_THROW(kInvalidArgument,
                 "{}: the record has no \"{}\" field (its fields: {}); name the field that holds "
                 "the text with --text-field NAME, or give chat records (messages, "
                 "conversations or instruction)",
                 r.where, o.text_field, fields.empty() ? "none" : fields);
  }
  STRATA_REQUIRE(it->is_string(), "{}: field \"{}\" is a {}, not the document's text (a string)",
                 r.where, o.text_field, it->type_name());
  return Record{it->get<std::string>(), Json()};
}

Document to_document(const Tokenizer& tok, const RawDoc& r, const CorpusOptions& o,
                     bool* truncated) {
  Document d;
  Record rec;
  if (r.json_line) rec = parse_record(r, o);
  if (!rec.chat.is_null()) {
    d = o.chat ? o.chat(tok, rec.chat, r.where) : encode_chat_record(tok, rec.chat, r.where);
    STRATA_CHECK(d.counted.size() == d.tokens.size(),
                 "{}: the chat encoder gave {} tokens and {} counted flags", r.where,
                 d.tokens.size(), d.counted.size());
    if (!d.counted.empty()) d.counted[0] = 0;
  } else {
    d = encode_text(tok, r.json_line ? rec.text : r.text, r.where);
  }
  const std::int32_t vocab = tok.vocab_size();
  for (std::int32_t id : d.tokens)
    STRATA_CHECK(id >= 0 && id < vocab, "{}: token id {} outside the tokenizer's {}", r.where, id,
                 vocab);
  *truncated = false;
  if (o.max_document_tokens > 0 && d.tokens.size() > o.max_document_tokens) {
    d.tokens.resize(o.max_document_tokens);
    d.counted.resize(o.max_document_tokens);
    *truncated = true;
  }
  return d;
}

void put_u32(std::uint8_t* p, std::uint32_t v) { std::memcpy(p, &v, 4); }
void put_u64(std::uint8_t* p, std::uint64_t v) { std::memcpy(p, &v, 8); }
std::uint32_t get_u32(const std::uint8_t* p) {
  std::uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
std::uint64_t get_u64(const std::uint8_t* p) {
  std::uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
std::uint64_t align8(std::uint64_t n) { return (n + 7) / 8 * 8; }

std::array<std::uint8_t, 16> parse_hash(const std::string& hex) {
  std::array<std::uint8_t, 16> h{};
  STRATA_CHECK(hex.size() == 32, "tokenizer hash '{}' is not 32 hex digits", hex);
  for (int i = 0; i < 16; ++i) h[i] = std::uint8_t(std::stoul(hex.substr(2 * i, 2), nullptr, 16));
  return h;
}

// Streams a prepared file: tokens go to the temporary file as documents arrive; the mask bits
// and the documents' starts are kept and written at finish(), then the header, then the rename.
class PreparedWriter {
 public:
  PreparedWriter(std::string out, std::uint64_t vocab, const std::string& hash_hex,
                 std::string source)
      : out_(std::move(out)),
        // A stream (-o /dev/null, a pipe, /dev/stdout): written into, never replaced.
        mode_(!written_in_place(out_) ? Mode::kRenamed
              : null_device(out_)     ? Mode::kDropped
                                      : Mode::kCopied),
        tmp_(out_ + fmt::format(".tmp.{}.{}", this_host(), ::getpid())) {
    h_.vocab_size = vocab;
    h_.token_bytes = vocab <= 65536 ? 2 : 4;
    h_.tokenizer_hash = parse_hash(hash_hex);
    h_.source = std::move(source);
    h_.source_bytes = h_.source.size();
    h_.tokens_offset = align8(kPreparedHeaderBytes + h_.source_bytes);
    if (mode_ == Mode::kDropped) {  // written to the null device itself: nothing kept anywhere
      tmp_ = out_;
      fd_ = ::open(out_.c_str(), O_WRONLY | O_CLOEXEC);
    } else if (mode_ == Mode::kCopied) {
      // An unnamed file in the temporary folder (no name another user could plant a link at; gone
      // with the process however it ends), its bytes copied into the stream at the end.
      const char* dir = std::getenv("TMPDIR");
      const std::string folder = dir && *dir ? dir : "/tmp";
      tmp_ =
          fmt::format("an unnamed temporary file in {}{}", folder, dir && *dir ? " (TMPDIR)" : "");
      fd_ = ::open(folder.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
      if (const int err = errno; fd_ < 0)
        detail::throw_errno(
            __FILE__, __LINE__, "open", err,
            fmt::format("-o {} is a stream, and the prepared file is made whole before it is "
                        "written there: cannot make {}: set TMPDIR to a folder with room for it, "
                        "or give -o a file",
                        out_, tmp_));
    } else {
      remove_dead_runs_files();
      // Ctrl-C leaves no corpus-sized file: registered before the file is made, so that no
      // signal finds it made and not registered.
      slot_ = core::remove_file_on_interrupt(tmp_);
      fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    }
    if (fd_ < 0) {
      const int err = errno;
      core::forget_interrupt_file(slot_);
      detail::throw_errno(__FILE__, __LINE__, "open", err,
                          fmt::format("cannot write the prepared file {}", tmp_));
    }
    std::string head(h_.tokens_offset, '\0');
    std::memcpy(head.data() + kPreparedHeaderBytes, h_.source.data(), h_.source.size());
    try {
      write(head.data(), head.size());
    } catch (...) {  // (no destructor runs for a constructor that throws)
      ::close(fd_);
      if (mode_ == Mode::kRenamed) ::unlink(tmp_.c_str());
      core::forget_interrupt_file(slot_);
      throw;
    }
  }
  ~PreparedWriter() {
    if (fd_ >= 0) {
      ::close(fd_);
      if (mode_ == Mode::kRenamed) ::unlink(tmp_.c_str());
    }
    core::forget_interrupt_file(slot_);
  }

  void add(const Document& d, bool truncated) {
    starts_.push_back(h_.tokens);
    for (std::size_t i = 0; i < d.tokens.size(); ++i) {
      const std::uint32_t id = std::uint32_t(d.tokens[i]);
      if (h_.token_bytes == 2) {
        const std::uint16_t v = std::uint16_t(id);
        buf_.append(reinterpret_cast<const char*>(&v), 2);
      } else {
        buf_.append(reinterpret_cast<const char*>(&id), 4);
      }
      const std::uint64_t t = h_.tokens + i;
      if (t / 8 >= mask_.size()) mask_.push_back(0);
      if (d.counted[i]) {
        mask_[t / 8] |= std::uint8_t(1u << (t % 8));
        ++h_.counted_tokens;
      }
    }
    if (buf_.size() >= (std::size_t(1) << 20)) flush_tokens();
    h_.tokens += d.tokens.size();
    ++h_.documents;
    h_.truncated_documents += truncated;
  }

  const PreparedHeader& header() const { return h_; }

  void flush_tokens() {
    write(buf_.data(), buf_.size());
    buf_.clear();
  }

  void finish() {
    flush_tokens();
    const std::uint64_t end_tokens = h_.tokens_offset + h_.tokens * h_.token_bytes;
    h_.mask_offset = align8(end_tokens);
    h_.starts_offset = align8(h_.mask_offset + mask_.size());
    h_.file_bytes = h_.starts_offset + 8 * starts_.size();
    pad_to(end_tokens, h_.mask_offset);
    write(mask_.data(), mask_.size());
    pad_to(h_.mask_offset + mask_.size(), h_.starts_offset);
    write(starts_.data(), 8 * starts_.size());
    std::uint8_t head[kPreparedHeaderBytes] = {};
    std::memcpy(head, kPreparedMagic, 8);
    put_u32(head + 8, h_.version);
    put_u32(head + 12, h_.token_bytes);
    put_u64(head + 16, h_.vocab_size);
    std::memcpy(head + 24, h_.tokenizer_hash.data(), 16);
    put_u64(head + 40, h_.documents);
    put_u64(head + 48, h_.tokens);
    put_u64(head + 56, h_.counted_tokens);
    put_u64(head + 64, h_.truncated_documents);
    put_u64(head + 72, h_.source_bytes);
    put_u64(head + 80, h_.tokens_offset);
    put_u64(head + 88, h_.mask_offset);
    put_u64(head + 96, h_.starts_offset);
    put_u64(head + 104, h_.file_bytes);
    if (::pwrite(fd_, head, sizeof head, 0) != ssize_t(sizeof head))
      detail::throw_errno(__FILE__, __LINE__, "pwrite", errno,
                          fmt::format("cannot write the header of {}", tmp_));
    if (mode_ == Mode::kDropped) {
      STRATA_CHECK_ERRNO(::close(fd_), "close {}", out_);
      fd_ = -1;
      return;
    }
    if (mode_ == Mode::kCopied) {
      const int err = copy_into(fd_, out_);
      ::close(fd_);  // (the unnamed file goes with it)
      fd_ = -1;
      if (err != 0)
        detail::throw_errno(__FILE__, __LINE__, "write", err,
                            fmt::format("cannot write the prepared file into {}", out_));
      return;
    }
    STRATA_CHECK_ERRNO(::fsync(fd_), "fsync {}", tmp_);
    STRATA_CHECK_ERRNO(::close(fd_), "close {}", tmp_);
    fd_ = -1;
    const int renamed = ::rename(tmp_.c_str(), out_.c_str());
    const int err = errno;
    core::forget_interrupt_file(slot_);
    slot_ = -1;
    if (renamed != 0) {
      ::unlink(tmp_.c_str());
      detail::throw_errno(__FILE__, __LINE__, "rename", err,
                          fmt::format("cannot move {} into place as {}", tmp_, out_));
    }
  }

 private:
  // The temporary files of this output left by runs of this host that are gone (killed with
  // SIGKILL, or out of memory): <out>.tmp.<host>.<pid> whose process no longer exists here
  // (another host's, on a shared drive, may still be written).
  void remove_dead_runs_files() const {
    std::error_code ec;
    const fs::path out(out_);
    const fs::path dir = out.has_parent_path() ? out.parent_path() : fs::path(".");
    const std::string prefix = out.filename().string() + ".tmp." + this_host() + ".";
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      const std::string name = e.path().filename().string();
      if (!name.starts_with(prefix) || name.size() == prefix.size()) continue;
      const std::string pid = name.substr(prefix.size());
      if (pid.find_first_not_of("0123456789") != std::string::npos || pid.size() > 9) continue;
      const long p = std::stol(pid);
      if (p == long(::getpid()) || !process_gone(p)) continue;
      if (fs::remove(e.path(), ec))
        log::info("{}: removed {}, left by a run that ended before finishing it (process {})", out_,
                  name, pid);
    }
  }

  void write(const void* p, std::size_t n) {
    if (const int err = write_fd_fully(fd_, p, n))
      detail::throw_errno(__FILE__, __LINE__, "write", err,
                          fmt::format("cannot write the prepared file {}", tmp_));
  }
  void pad_to(std::uint64_t at, std::uint64_t to) {
    static const char zeros[8] = {};
    write(zeros, std::size_t(to - at));
  }

  std::string out_;
  // kRenamed: a file beside out_ renamed over it; kCopied: out_ is a stream, an unnamed file's
  // bytes written into it; kDropped: out_ is the null device, written directly.
  enum class Mode { kRenamed, kCopied, kDropped } mode_;
  std::string tmp_;  // where the bytes go first (for messages: kCopied's names its folder)
  int fd_ = -1;
  int slot_ = -1;  // core::remove_file_on_interrupt's
  PreparedHeader h_;
  std::string buf_;  // tokens not yet written (written by the MiB)
  std::vector<std::uint8_t> mask_;
  std::vector<std::uint64_t> starts_;
};

}  // namespace

std::string tokenizer_hash(const fs::path& dir, const Tokenizer& tok) {
  const fs::path file = Tokenizer::file_in(dir);
  STRATA_REQUIRE(!file.empty(), "{}: neither tokenizer.json nor tokenizer.model in the folder",
                 dir.string());
  std::string bytes = slurp(file.string(), "tokenizer");
  auto opt = [](std::optional<std::int32_t> v) {
    return v ? std::to_string(*v) : std::string("-");
  };
  bytes += fmt::format("\nstrata-special-tokens bos={} eos={} pad={} adds_bos={}",
                       opt(tok.bos_id()), opt(tok.eos_id()), opt(tok.pad_id()), tok.adds_bos());

  // A SentencePiece model takes two more settings from tokenizer_config.json that change its ids:
  // add_eos_token and legacy. Each is added only where it is not the default, so a file prepared
  // under the defaults keeps its hash.
  const fs::path config = dir / "tokenizer_config.json";
  // A Llama-class tokenizer.json takes add_eos_token too (Hugging Face's LlamaTokenizerFast
  // rebuilds its template; add_bos_token is in adds_bos above).
  if (fs::exists(config)) {
    const Json c = config::try_parse(slurp(config.string(), "tokenizer config")).value_or(Json());
    const auto is = [&](const char* key, bool v) {
      return c.is_object() && c.contains(key) && c[key].is_boolean() && c[key].get<bool>() == v;
    };
    const std::string cls = c.is_object() && c.value("tokenizer_class", Json()).is_string()
                                ? c["tokenizer_class"].get<std::string>()
                                : std::string();
    const bool llama_class = cls.starts_with("LlamaTokenizer") ||
                             cls.starts_with("CodeLlamaTokenizer") ||
                             cls.starts_with("GemmaTokenizer");
    if ((file.filename() == "tokenizer.model" || llama_class) && is("add_eos_token", true))
      bytes += " add_eos_token=true";
    if (file.filename() == "tokenizer.model" && is("legacy", false)) bytes += " legacy=false";
  }
  const XXH128_hash_t h = XXH3_128bits(bytes.data(), bytes.size());
  std::array<std::uint8_t, 16> b{};
  put_u64(b.data(), h.low64);
  put_u64(b.data() + 8, h.high64);
  std::string hex;
  for (std::uint8_t x : b) hex += fmt::format("{:02x}", x);
  return hex;
}

std::string PreparedHeader::tokenizer_hash_hex() const {
  std::string hex;
  for (std::uint8_t x : tokenizer_hash) hex += fmt::format("{:02x}", x);
  return hex;
}

std::vector<Document> read_corpus_file(const Tokenizer& tok, const std::string& path,
                                       const CorpusOptions& o) {
  std::vector<Document> out;
  read_raw(path, o, [&](RawDoc&& r) {
    bool truncated = false;
    out.push_back(to_document(tok, r, o, &truncated));
  });
  return out;
}

std::string file_sample_hash(const std::string& path, std::uint64_t size) {
  constexpr std::uint64_t kEnd = std::uint64_t(1) << 20;
  std::ifstream in(path, std::ios::binary);
  if (!in) return "";
  std::string bytes(std::size_t(std::min(size, 2 * kEnd)), '\0');
  const std::size_t head = std::size_t(std::min<std::uint64_t>(bytes.size(), kEnd));
  in.read(bytes.data(), std::streamsize(head));
  if (bytes.size() > head) {
    in.seekg(std::streamoff(size - (bytes.size() - head)));
    in.read(bytes.data() + head, std::streamsize(bytes.size() - head));
  }
  if (!in) return "";
  bytes += fmt::format("|{}", size);
  return fmt::format("{:016x}", XXH3_64bits(bytes.data(), bytes.size()));
}

Json describe_sources(const std::vector<std::string>& inputs, const CorpusOptions& o) {
  // All of it is JSON text (the prepared file's record of its sources, a cache's key): UTF-8.
  const auto utf8_or_refuse = [](std::string_view what, std::string_view value,
                                 std::string_view fix) {
    const std::size_t bad = utf8::first_invalid(value);
    STRATA_REQUIRE(bad == std::string_view::npos,
                   "{} is not UTF-8 (byte {} of it, 0x{:02x}), and the prepared file records it as "
                   "text: {}",
                   what, bad, bad == std::string_view::npos ? 0 : std::uint8_t(value[bad]), fix);
  };
  utf8_or_refuse("the --text-field name", o.text_field,
                 "give the field's name as UTF-8 (JSON keys are UTF-8)");
  if (o.separator)
    utf8_or_refuse("the --separator", *o.separator,
                   "give it as UTF-8 text (the corpus is UTF-8, so no other separator occurs "
                   "in it)");
  Json list = Json::array();
  for (const auto& p : inputs) {
    struct stat st {};
    if (::stat(p.c_str(), &st) != 0)
      detail::throw_errno(__FILE__, __LINE__, "stat", errno,
                          fmt::format("corpus file {} cannot be read", p));
    std::error_code ec;
    const fs::path abs = fs::absolute(p, ec);
    const std::string recorded = ec ? p : abs.lexically_normal().string();
    // (absolute: the working directory's name is checked too)
    utf8_or_refuse(fmt::format("the corpus path {}", recorded), recorded,
                   "rename the file or its folders, or link to it from a UTF-8 name");
    const std::string sample = file_sample_hash(p, std::uint64_t(st.st_size));
    if (sample.empty())
      detail::throw_errno(__FILE__, __LINE__, "read", errno,
                          fmt::format("corpus file {} cannot be read", p));
    list.push_back({{"path", recorded},
                    {"bytes", std::uint64_t(st.st_size)},
                    {"mtime_ns", std::int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec},
                    {"sample_xxh3", sample}});
  }
  // reader: how the inputs are read (2: JSON lines by .json too, a text file's BOM dropped,
  // separators of line ends at CRLF, one EOS): a cache of the same inputs read otherwise is not
  // reused.
  Json j = {{"inputs", list},
            {"reader", 2},
            {"text_field", o.text_field},
            {"max_document_tokens", o.max_document_tokens}};
  j["separator"] = o.separator ? Json(*o.separator) : Json();
  if (o.text_field_named) j["text_field_named"] = true;  // (absent: the files made before it)
  if (!o.chat_template.empty()) j["chat_template"] = Json::parse(o.chat_template);
  return j;
}

void write_prepared(const std::string& out, std::uint64_t vocab_size,
                    const std::string& tokenizer_hash_hex, const std::vector<Document>& docs,
                    const std::string& source_json, std::uint64_t truncated_documents) {
  PreparedWriter w(out, vocab_size, tokenizer_hash_hex, source_json);
  std::uint64_t left = truncated_documents;
  for (const auto& d : docs) {
    w.add(d, left > 0);
    if (left > 0) --left;
  }
  w.finish();
}

PrepSummary prepare_corpus(const Tokenizer& tok, const std::string& hash_hex,
                           const std::vector<std::string>& inputs, const std::string& out,
                           const CorpusOptions& o) {
  STRATA_REQUIRE(!inputs.empty(), "no input files given");
  const auto t0 = std::chrono::steady_clock::now();
  const Json sources = describe_sources(inputs, o);
  PrepSummary s;
  for (const auto& in : sources["inputs"]) s.input_bytes += in["bytes"].get<std::uint64_t>();
  s.threads = o.threads > 0 ? o.threads : int(std::max(1u, std::thread::hardware_concurrency()));
  s.tokenizer_hash = hash_hex;
  PreparedWriter w(out, std::uint64_t(tok.vocab_size()), hash_hex, sources.dump());
  tbb::task_arena arena(s.threads);
  // Documents are gathered in chunks of about this much text, tokenized in parallel and written
  // in order: memory stays bounded by the chunk, whatever the corpus.
  constexpr std::size_t kChunkBytes = std::size_t(8) << 20;
  std::vector<RawDoc> chunk;
  std::size_t chunk_bytes = 0;
  PrepProgress progress;
  progress.bytes_total = s.input_bytes;
  std::uint64_t bytes_before_file = 0;
  auto flush = [&] {
    std::vector<Document> docs(chunk.size());
    std::vector<char> cut(chunk.size(), 0);
    // Each document's error kept in its slot: the first in input order is the one reported,
    // whatever the threads' timing.
    std::vector<std::exception_ptr> failed(chunk.size());
    arena.execute([&] {
      tbb::parallel_for(std::size_t(0), chunk.size(), [&](std::size_t i) {
        try {
          bool t = false;
          docs[i] = to_document(tok, chunk[i], o, &t);
          cut[i] = t;
        } catch (...) {
          failed[i] = std::current_exception();
        }
      });
    });
    for (const auto& e : failed)
      if (e) std::rethrow_exception(e);
    for (std::size_t i = 0; i < docs.size(); ++i) w.add(docs[i], cut[i]);
    chunk.clear();
    chunk_bytes = 0;
    progress.documents = w.header().documents;
    progress.tokens = w.header().tokens;
    if (o.progress) o.progress(progress);
  };
  for (std::size_t f = 0; f < inputs.size(); ++f) {
    read_raw(inputs[f], o, [&](RawDoc&& r) {
      chunk_bytes += r.text.size();
      chunk.push_back(std::move(r));
      if (chunk_bytes >= kChunkBytes) flush();
    });
    bytes_before_file += sources["inputs"][f]["bytes"].get<std::uint64_t>();
    progress.bytes_done = bytes_before_file;
    flush();
  }
  const PreparedHeader& h = w.header();
  STRATA_REQUIRE(h.documents > 0,
                 "{} hold{} no document (empty, or only blank lines): give {} with text",
                 fmt::join(inputs, ", "), inputs.size() == 1 ? "s" : "",
                 inputs.size() == 1 ? "a file" : "files");
  s.documents = h.documents;
  s.tokens = h.tokens;
  s.counted_tokens = h.counted_tokens;
  s.truncated_documents = h.truncated_documents;
  w.finish();
  s.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return s;
}

// ---- reading ----

namespace {

bool ends_with_any_case(std::string_view path, std::string_view suffix) {
  if (path.size() < suffix.size()) return false;
  const std::string_view tail = path.substr(path.size() - suffix.size());
  for (std::size_t i = 0; i < tail.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(tail[i])) != suffix[i]) return false;
  return true;
}

}  // namespace

bool is_json_lines_file(const std::string& path) {
  return ends_with_any_case(path, ".jsonl") || ends_with_any_case(path, ".ndjson") ||
         ends_with_any_case(path, ".json");
}

bool is_text_corpus_file(const std::string& path) { return ends_with_any_case(path, ".txt"); }

bool is_corpus_file(const std::string& path) {
  return is_json_lines_file(path) || is_text_corpus_file(path);
}

bool is_prepared_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  char m[8] = {};
  return f.read(m, 8) && std::memcmp(m, kPreparedMagic, 8) == 0;
}

namespace {

// `p` holds the file's first `avail` bytes (at least the header and the source description when
// they are in the file); `size` is the file's size.
PreparedHeader parse_header(const std::string& path, const std::uint8_t* p, std::size_t avail,
                            std::size_t size) {
  STRATA_REQUIRE(avail >= 8 && std::memcmp(p, kPreparedMagic, 8) == 0,
                 "{}: not a prepared training file (it does not start with the magic "
                 "\"STRATAPD\"); make one with strata-prep",
                 path);
  STRATA_REQUIRE(avail >= kPreparedHeaderBytes,
                 "{}: truncated: {} bytes, shorter than the prepared file's {}-byte header", path,
                 size, kPreparedHeaderBytes);
  PreparedHeader h;
  h.version = get_u32(p + 8);
  STRATA_REQUIRE(h.version >= 1, "{}: prepared file version {} is not valid (damaged header)", path,
                 h.version);
  STRATA_REQUIRE(h.version <= kPreparedVersion,
                 "{}: prepared file version {} is newer than this strata reads ({}): prepare it "
                 "again with this strata-prep, or update strata",
                 path, h.version, kPreparedVersion);
  h.token_bytes = get_u32(p + 12);
  h.vocab_size = get_u64(p + 16);
  std::memcpy(h.tokenizer_hash.data(), p + 24, 16);
  h.documents = get_u64(p + 40);
  h.tokens = get_u64(p + 48);
  h.counted_tokens = get_u64(p + 56);
  h.truncated_documents = get_u64(p + 64);
  h.source_bytes = get_u64(p + 72);
  h.tokens_offset = get_u64(p + 80);
  h.mask_offset = get_u64(p + 88);
  h.starts_offset = get_u64(p + 96);
  h.file_bytes = get_u64(p + 104);
  const std::string damaged = fmt::format("{}: damaged prepared file header", path);
  STRATA_REQUIRE(h.token_bytes == 2 || h.token_bytes == 4,
                 "{}: token width {} at offset 12 is not 2 or 4", damaged, h.token_bytes);
  STRATA_REQUIRE(h.vocab_size > 0 && h.vocab_size <= (std::uint64_t(1) << 31) &&
                     (h.token_bytes == 4 || h.vocab_size <= 65536),
                 "{}: vocab_size {} does not fit its {}-byte ids", damaged, h.vocab_size,
                 h.token_bytes);
  STRATA_REQUIRE(h.file_bytes == size,
                 "{}: truncated or extended: the header (offset 104) says {} bytes, the file has "
                 "{}; prepare it again with strata-prep",
                 path, h.file_bytes, size);
  const bool fits = h.source_bytes <= size && h.tokens < (std::uint64_t(1) << 40) &&
                    h.documents <= h.tokens && h.counted_tokens <= h.tokens &&
                    h.truncated_documents <= h.documents &&
                    h.tokens_offset == align8(kPreparedHeaderBytes + h.source_bytes) &&
                    h.mask_offset == align8(h.tokens_offset + h.tokens * h.token_bytes) &&
                    h.starts_offset == align8(h.mask_offset + (h.tokens + 7) / 8) &&
                    h.file_bytes == h.starts_offset + 8 * h.documents;
  STRATA_REQUIRE(fits,
                 "{}: its counts ({} documents, {} tokens, {} counted) and section offsets "
                 "(tokens {}, mask {}, starts {}, end {}) disagree; prepare it again with "
                 "strata-prep",
                 damaged, h.documents, h.tokens, h.counted_tokens, h.tokens_offset, h.mask_offset,
                 h.starts_offset, h.file_bytes);
  STRATA_CHECK(kPreparedHeaderBytes + h.source_bytes <= avail, "{}: source description not read",
               path);
  h.source.assign(reinterpret_cast<const char*>(p + kPreparedHeaderBytes), h.source_bytes);
  return h;
}

}  // namespace

PreparedHeader read_prepared_header(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) STRATA_THROW(kIo, "{} cannot be read: {}", path, std::strerror(errno));
  std::error_code ec;
  const std::size_t size = std::size_t(fs::file_size(path, ec));
  std::vector<std::uint8_t> head(std::min(size, kPreparedHeaderBytes));
  f.read(reinterpret_cast<char*>(head.data()), std::streamsize(head.size()));
  if (head.size() == kPreparedHeaderBytes) {
    // The source description follows the header, when the file holds it.
    const std::uint64_t src = get_u64(head.data() + 72);
    if (src <= size - kPreparedHeaderBytes) {
      head.resize(kPreparedHeaderBytes + std::size_t(src));
      f.read(reinterpret_cast<char*>(head.data() + kPreparedHeaderBytes), std::streamsize(src));
    }
  }
  return parse_header(path, head.data(), head.size(), size);
}

PreparedFile::PreparedFile(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    detail::throw_errno(__FILE__, __LINE__, "open", errno,
                        fmt::format("cannot open prepared file {}", path));
  struct stat st {};
  ::fstat(fd, &st);
  size_ = std::size_t(st.st_size);
  if (size_ > 0) {
    try {
      base_ = text::map_data_file(fd, size_, path);
    } catch (...) {
      ::close(fd);
      throw;
    }
  }
  ::close(fd);
  try {
    header_ = parse_header(path, base_, size_, size_);
    const PreparedHeader& h = header_;
    std::uint64_t prev = 0;
    for (std::uint64_t d = 0; d < h.documents; ++d) {
      const std::uint64_t s = get_u64(base_ + h.starts_offset + 8 * d);
      STRATA_REQUIRE((d == 0 ? s == 0 : s > prev) && s < h.tokens,
                     "{}: damaged: document {}'s start {} (offset {}) is not after the previous "
                     "one ({}) and below the {} tokens; prepare it again with strata-prep",
                     path, d, s, h.starts_offset + 8 * d, prev, h.tokens);
      prev = s;
    }
    std::uint64_t counted = 0;
    const std::uint8_t* m = base_ + h.mask_offset;
    for (std::uint64_t i = 0; i < (h.tokens + 7) / 8; ++i) counted += std::popcount(m[i]);
    STRATA_REQUIRE(counted == h.counted_tokens,
                   "{}: damaged: the target mask has {} counted tokens, the header (offset 56) "
                   "says {}; prepare it again with strata-prep",
                   path, counted, h.counted_tokens);
  } catch (...) {
    text::unmap_data_file(base_, size_);
    throw;
  }
}

PreparedFile::~PreparedFile() { text::unmap_data_file(base_, size_); }

std::int32_t PreparedFile::token(std::int64_t i) const {
  const std::uint8_t* p = base_ + header_.tokens_offset + std::size_t(i) * header_.token_bytes;
  if (header_.token_bytes == 2) {
    std::uint16_t v;
    std::memcpy(&v, p, 2);
    return v;
  }
  return std::int32_t(get_u32(p));
}

std::int64_t PreparedFile::doc_start(std::int64_t d) const {
  if (d >= documents()) return tokens();
  return std::int64_t(get_u64(base_ + header_.starts_offset + 8 * std::size_t(d)));
}

}  // namespace strata
