// Hugging Face tokenizer.json, read and run in C++ (strata/tokenizer.h).
//
// The file is a pipeline of components; each one this file implements is parsed into a plain
// struct once, and anything else stops the load with the file, the component and its type named —
// an unknown step is never skipped, since skipping one gives plausible but wrong ids. Encoding
// follows the `tokenizers` library's order: added tokens cut out of the raw text, then per span
// normalizer -> pre-tokenizer -> BPE model, then the post-processor's template.
//
// Regular expressions (Split's pattern, ByteLevel's GPT-2 pattern) are compiled by PCRE2 with UTF
// and UCP (\s, \p{L}, \p{N} are Unicode classes, as in Oniguruma, which the Rust library uses)
// and JIT where the platform allows. Normalization forms come from utf8proc.
//
// A folder with only a SentencePiece tokenizer.model is run by libsentencepiece behind the same
// added tokens, template and piece decoder (from_sentencepiece).
//
// Invariants: everything is built in from_json / from_sentencepiece and read-only afterwards
// (encode/decode are const and hold no shared mutable state: each call makes its own PCRE2 match
// data, and the cache of words' ids is per thread, tagged with the tokenizer it belongs to), so
// one Tokenizer serves any number of threads.
#include "strata/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <sentencepiece_processor.h>
#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <fstream>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>
#include <unordered_map>
#include <variant>

#include "core/file_kind.h"
#include "core/utf8.h"
#include "strata/error.h"
#include "strata/json_config.h"
#include "strata/paths.h"

namespace strata {
namespace {

using Json = nlohmann::json;

// ---- UTF-8 ----

// Length of the valid UTF-8 character at s[i], or 0 when the bytes there are not one (bad lead
// byte, bad continuation, overlong, surrogate, above U+10FFFF, or cut off by the end).
std::size_t utf8_char_len(std::string_view s, std::size_t i) { return utf8::sequence_length(s, i); }

// How many bytes from s[i] are a valid beginning of a character cut off by the end of `s` (0 when
// they are not one): a stream decoder waits for the rest of those.
std::size_t utf8_incomplete_tail(std::string_view s, std::size_t i) {
  const std::size_t left = s.size() - i;
  const unsigned char c = static_cast<unsigned char>(s[i]);
  std::size_t n = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC2 ? 2 : 0;
  if (n == 0 || left >= n) return 0;
  // Pad with the smallest continuation bytes the lead allows and check what is there.
  std::string probe(s.substr(i));
  while (probe.size() < n) probe.push_back(static_cast<char>(0x80));
  if (utf8_char_len(probe, 0) == n) return left;
  // E0/F0 need a higher second byte; ED/F4 a lower one: try the other end of the range.
  probe.assign(s.substr(i));
  while (probe.size() < n) probe.push_back(static_cast<char>(probe.size() == 1 ? 0x9F : 0x80));
  if (utf8_char_len(probe, 0) == n) return left;
  probe.assign(s.substr(i));
  while (probe.size() < n) probe.push_back(static_cast<char>(probe.size() == 1 ? 0xA0 : 0x80));
  return utf8_char_len(probe, 0) == n ? left : 0;
}

constexpr std::string_view kMetaspace = "\u2581";

std::string utf8_encode(char32_t cp) {
  std::string out;
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
  return out;
}

std::string replace_all(std::string s, std::string_view from, std::string_view to) {
  if (from.empty()) return s;
  std::string out;
  std::size_t pos = 0;
  for (std::size_t hit; (hit = s.find(from, pos)) != std::string::npos; pos = hit + from.size()) {
    out.append(s, pos, hit - pos);
    out.append(to);
  }
  out.append(s, pos);
  return out;
}

// ---- byte-level: GPT-2's map of the 256 bytes onto printable characters ----

struct ByteMap {
  std::array<std::string, 256> to_char;                    // byte -> its character (UTF-8)
  std::unordered_map<std::string, unsigned char> to_byte;  // the reverse
  ByteMap() {
    // Printable Latin-1 bytes stand for themselves; the rest take U+0100 upwards in byte order.
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      to_char[b] = utf8_encode(printable ? static_cast<char32_t>(b) : next++);
      to_byte[to_char[b]] = static_cast<unsigned char>(b);
    }
  }
};

const ByteMap& byte_map() {
  static const ByteMap m;
  return m;
}

// ---- PCRE2 ----

// GPT-2's pattern, which ByteLevel with use_regex applies.
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

class Regex {
 public:
  Regex(std::string_view pattern, bool literal, const std::string& origin) {
    int err = 0;
    PCRE2_SIZE at = 0;
    const std::uint32_t opts =
        PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK | (literal ? PCRE2_LITERAL : 0);
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), opts, &err,
                          &at, nullptr);
    if (code_ == nullptr) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof msg);
      STRATA_THROW(kUnsupported,
                   "{}: the pre-tokenizer pattern /{}/ does not compile with PCRE2 at offset {}: "
                   "{}; the pattern is Oniguruma syntax that PCRE2 lacks — report it with the "
                   "model's name",
                   origin, pattern, at, reinterpret_cast<const char*>(msg));
    }
    // JIT where the platform permits it; the interpreter gives the same matches otherwise.
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);
  }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  ~Regex() { pcre2_code_free(code_); }

  // Every non-overlapping match of the pattern in `s` (valid UTF-8), as [begin, end) byte ranges.
  std::vector<std::pair<std::size_t, std::size_t>> find_all(std::string_view s) const {
    std::vector<std::pair<std::size_t, std::size_t>> out;
    const MatchState& m = match_state();
    std::size_t pos = 0;
    while (pos <= s.size()) {
      // rc 0: matched, with more groups than the match data holds (only the whole match is read).
      const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), pos,
                                 PCRE2_NO_UTF_CHECK, m.md.get(), m.ctx.get());
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(rc, msg, sizeof msg);
        STRATA_THROW(kInternal, "PCRE2 failed matching a pre-tokenizer pattern: {}",
                     reinterpret_cast<const char*>(msg));
      }
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(m.md.get());
      const std::size_t b = ov[0], e = ov[1];
      if (e == b) {
        // An empty match splits nothing: step over one character.
        if (b >= s.size()) break;
        pos = b + std::max<std::size_t>(1, utf8_char_len(s, b));
        continue;
      }
      out.emplace_back(b, e);
      pos = e;
    }
    return out;
  }

 private:
  // A thread's match data, JIT stack and match context, made once per thread and shared by every
  // pattern (none of them depends on the pattern: only the whole match is read), so an encode
  // maps no memory: creating a JIT stack per call cost an mmap and a munmap each time.
  struct MatchState {
    std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> md{
        pcre2_match_data_create(1, nullptr), &pcre2_match_data_free};
    // Long whitespace runs recurse deeply under (?!\S): give JIT more than its 32 KiB default.
    std::unique_ptr<pcre2_jit_stack, decltype(&pcre2_jit_stack_free)> stack{
        pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr), &pcre2_jit_stack_free};
    std::unique_ptr<pcre2_match_context, decltype(&pcre2_match_context_free)> ctx{
        pcre2_match_context_create(nullptr), &pcre2_match_context_free};
    MatchState() {
      STRATA_CHECK(md && stack && ctx, "PCRE2 could not allocate match data");
      pcre2_jit_stack_assign(ctx.get(), nullptr, stack.get());
    }
  };
  static const MatchState& match_state() {
    thread_local const MatchState state;
    return state;
  }

  pcre2_code* code_ = nullptr;
};

// ---- pipeline components ----

struct Nfx {
  utf8proc_option_t options;
};
struct Prepend {
  std::string text;
};
struct Replace {
  std::string from, to;
};
using NormalizerStep = std::variant<Nfx, Prepend, Replace>;

struct Split {
  std::shared_ptr<Regex> regex;
  bool removed;  // behavior Removed (matches dropped) rather than Isolated
};
struct ByteLevelPre {
  bool add_prefix_space;
  std::shared_ptr<Regex> regex;  // GPT-2's pattern when use_regex, else null
};
// Spaces become `replacement` ("▁"), one is put first (always; only at the start of the text;
// never), and with `split` each replacement starts a new piece.
struct MetaspacePre {
  enum class Prepend { kAlways, kFirst, kNever };
  std::string replacement;
  Prepend prepend;
  bool split;
};
using PreStep = std::variant<Split, ByteLevelPre, MetaspacePre>;

struct AddedToken {
  std::string content;
  std::int32_t id;
  bool special, lstrip, rstrip;
};

enum class DecoderKind { kByteLevel, kPieces };

// An open-addressing hash table from 64-bit keys to two ints, for the lookups on encode's hot
// path (a merge per adjacent pair, a vocabulary id per character): one probe into a flat array,
// where std::unordered_map chases a node per lookup. Filled once, then read-only.
class FlatMap64 {
 public:
  struct Slot {
    std::uint64_t key;
    std::int32_t first, second;
  };
  void reserve(std::size_t n) {
    std::size_t cap = 16;
    while (cap < 2 * n) cap *= 2;
    slots_.assign(cap, Slot{kEmpty, 0, 0});
    mask_ = cap - 1;
  }
  // Inserts unless `key` is there already (the first insertion wins). reserve() first.
  void insert(std::uint64_t key, std::int32_t first, std::int32_t second) {
    for (std::size_t i = hash(key) & mask_;; i = (i + 1) & mask_) {
      if (slots_[i].key == key) return;
      if (slots_[i].key == kEmpty) {
        slots_[i] = Slot{key, first, second};
        return;
      }
    }
  }
  const Slot* find(std::uint64_t key) const {
    if (slots_.empty()) return nullptr;
    for (std::size_t i = hash(key) & mask_;; i = (i + 1) & mask_) {
      if (slots_[i].key == key) return &slots_[i];
      if (slots_[i].key == kEmpty) return nullptr;
    }
  }

 private:
  static constexpr std::uint64_t kEmpty = ~std::uint64_t{0};
  static std::size_t hash(std::uint64_t k) {  // murmur3's finaliser
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return static_cast<std::size_t>(k);
  }
  std::vector<Slot> slots_;
  std::size_t mask_ = 0;
};

// One character's UTF-8 bytes (1-4) as a key: the bytes and the length.
std::uint64_t char_key(std::string_view ch) {
  std::uint64_t k = ch.size();
  for (unsigned char c : ch) k = (k << 8) | c;
  return k;
}

struct StringHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

struct Bpe {
  std::unordered_map<std::string, std::int32_t, StringHash, std::equal_to<>> vocab;
  // (left id << 32 | right id) -> (rank, merged id)
  FlatMap64 merges;
  // The vocabulary's one-character tokens (char_key) -> (id, unused).
  FlatMap64 chars;
  std::optional<std::int32_t> unk;
  bool byte_fallback = false, fuse_unk = false, ignore_merges = false;
  std::array<std::int32_t, 256> byte_ids{};  // "<0xXX>" ids for byte_fallback, -1 when absent
};

// Unicode's White_Space, as Rust's char::is_whitespace (what an added token's lstrip / rstrip
// absorbs in Hugging Face's tokenizers): U+0085, U+00A0, U+1680, U+2000-U+200A, U+2028, U+2029,
// U+202F, U+205F, U+3000 beside the ASCII ones.
bool is_unicode_space(char32_t c) {
  return c == 0x20 || (c >= 0x09 && c <= 0x0D) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

// The code point of the well-formed sequence of `n` bytes at s[i].
char32_t code_point(std::string_view s, std::size_t i, std::size_t n) {
  const auto b = [&](std::size_t k) { return char32_t(static_cast<unsigned char>(s[i + k])); };
  if (n == 1) return b(0);
  if (n == 2) return (b(0) & 0x1F) << 6 | (b(1) & 0x3F);
  if (n == 3) return (b(0) & 0x0F) << 12 | (b(1) & 0x3F) << 6 | (b(2) & 0x3F);
  return (b(0) & 0x07) << 18 | (b(1) & 0x3F) << 12 | (b(2) & 0x3F) << 6 | (b(3) & 0x3F);
}

// The bytes of the whitespace character starting at s[i] (0: none there).
std::size_t space_at(std::string_view s, std::size_t i) {
  if (i >= s.size()) return 0;
  const std::size_t n = utf8::sequence_length(s, i);
  return n > 0 && is_unicode_space(code_point(s, i, n)) ? n : 0;
}

// The bytes of the whitespace character ending at s[end] (0: none), not reaching below `begin`.
std::size_t space_before(std::string_view s, std::size_t begin, std::size_t end) {
  for (std::size_t n = 1; n <= 4 && n <= end - begin; ++n) {
    const std::size_t i = end - n;
    if ((static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) continue;  // a continuation byte
    return utf8::sequence_length(s, i) == n && is_unicode_space(code_point(s, i, n)) ? n : 0;
  }
  return 0;
}

std::string json_token(const Json& j) {
  if (j.is_string()) return j.get<std::string>();
  if (j.is_object() && j.contains("content") && j["content"].is_string())
    return j["content"].get<std::string>();
  return {};
}

}  // namespace

struct Tokenizer::Impl {
  std::string origin;
  Bpe bpe;
  std::vector<std::string> id_to_token;
  std::vector<bool> special;
  std::vector<AddedToken> added;                                  // longest first
  std::array<std::vector<std::size_t>, 256> added_by_first_byte;  // indexes into `added`
  std::vector<NormalizerStep> normalizer;
  std::vector<PreStep> pre;
  std::vector<std::int32_t> template_prefix, template_suffix;
  DecoderKind decoder = DecoderKind::kByteLevel;
  std::vector<Replace> decoder_replace;  // kPieces: applied to each token in order
  bool decoder_byte_fallback = false;    // kPieces: "<0xXX>" -> the byte
  std::size_t decoder_strip_first = 0;   // kPieces: leading spaces stripped off the text
  // kPieces, a Metaspace decoder: its replacement becomes a space, and is dropped in the first
  // token when the pre-tokenizer put one first.
  std::string decoder_metaspace;
  bool decoder_metaspace_drop_first = false;
  std::optional<std::int32_t> bos, eos, pad;
  // A SentencePiece tokenizer.model instead of tokenizer.json: the library encodes each span
  // between added tokens (its own normalizer, model and byte fallback); the tables above are
  // filled from its pieces, so decoding, the added tokens and the template are shared.
  std::unique_ptr<sentencepiece::SentencePieceProcessor> spm;
  // No pre-tokenizer, and no token has a "▁" after another character (Llama 2, Mistral): a BPE
  // piece is merged as the words it splits into before each such "▁" — no merge can cross one,
  // so the ids are the same, and a word's ids can be cached.
  bool split_before_metaspace = false;
  // Tells the per-thread word caches of different tokenizers apart.
  std::uint64_t serial = 0;
  // tokenizer_config.json's legacy: false — a span after an added token gets no "▁" put first
  // (Hugging Face encodes unk's text before it and drops that many ids: `spm_legacy_skip`).
  bool spm_legacy = true;
  std::string spm_unk_text;
  std::size_t spm_legacy_skip = 0;
  // A BPE model that only turns spaces into "▁" (normalizer "identity", a "▁" put first, spaces
  // kept) and has no piece with "▁" after another character (Llama 2): no merge crosses a space,
  // so a span is encoded as its words, each cached (spm_words): the same ids.
  bool spm_split_words = false;
  std::int32_t spm_metaspace_id = -1;

  [[noreturn]] void unsupported(std::string_view where, std::string_view type,
                                std::string_view supported) const {
    STRATA_THROW(kUnsupported,
                 "{}: {} type '{}' is not supported yet (supported: {}); tokenize with Hugging "
                 "Face and pass token ids for this model until it is",
                 origin, where, type, supported);
  }
  [[noreturn]] void malformed(std::string_view what) const {
    STRATA_THROW(kInvalidArgument,
                 "{}: {}; the file is not a valid Hugging Face tokenizer.json — re-download it "
                 "or save it again with the tokenizers library",
                 origin, what);
  }

  // An id the file gives (`where` names it): a whole number from 0 below 2^24 (vocabularies in
  // use hold under 2^20; a wider id was cut to 32 bits, or sized a table of billions).
  std::int32_t token_id(const Json& v, std::string_view where) const {
    constexpr std::int64_t kMaxId = (std::int64_t(1) << 24) - 1;
    if (!v.is_number_integer() || v.get<std::int64_t>() < 0 || v.get<std::int64_t>() > kMaxId)
      malformed(fmt::format("{} = {} is not a token id (a whole number from 0 to {})", where,
                            v.dump(), kMaxId));
    return static_cast<std::int32_t>(v.get<std::int64_t>());
  }

  void parse(const Json& tj, const Json& cj);
  void parse_model(const Json& m);
  void parse_added(const Json& a);
  void parse_normalizer(const Json& n);
  void parse_pre(const Json& p);
  void parse_post(const Json& p);
  void parse_decoder(const Json& d);
  void parse_config(const Json& c);
  void index_added();
  void build_char_ids();
  void find_metaspace_words();
  void merge_word(std::string_view w, std::vector<std::int32_t>& out) const;
  void load_sentencepiece(std::string_view model, const Json& cj);
  void spm_encode(std::string_view s, std::vector<std::int32_t>& out) const;
  void spm_words(std::string_view span, std::vector<std::int32_t>& out) const;

  std::string normalize(std::string s) const;
  // `at_start`: `s` begins the text (Metaspace's prepend_scheme "first").
  std::vector<std::string> pre_tokenize(std::string s, bool at_start) const;
  void bpe_word(std::string_view w, std::vector<std::int32_t>& out) const;
  void encode_span(std::string_view span, bool at_start, std::vector<std::int32_t>& out) const;
};

void Tokenizer::Impl::parse(const Json& tj, const Json& cj) {
  if (!tj.is_object()) malformed("the top level is not a JSON object");
  if (!tj.contains("model") || !tj["model"].is_object()) malformed("no 'model' object");
  parse_model(tj["model"]);
  if (tj.contains("added_tokens")) parse_added(tj["added_tokens"]);
  parse_normalizer(tj.value("normalizer", Json()));
  parse_pre(tj.value("pre_tokenizer", Json()));
  parse_post(tj.value("post_processor", Json()));
  parse_decoder(tj.value("decoder", Json()));
  if (cj.is_object()) parse_config(cj);
  // Hugging Face's LlamaTokenizerFast (and CodeLlama's, Gemma's) rebuilds the post-processor
  // from tokenizer_config.json's add_bos_token (default true) and add_eos_token (default false):
  // a Llama 2 folder with add_bos_token false encodes without its BOS.
  if (cj.is_object() && cj.value("tokenizer_class", Json()).is_string()) {
    const std::string cls = cj["tokenizer_class"].get<std::string>();
    if (cls.starts_with("LlamaTokenizer") || cls.starts_with("CodeLlamaTokenizer") ||
        cls.starts_with("GemmaTokenizer")) {
      const auto flag = [&](const char* key, bool fallback) {
        const Json v = cj.value(key, Json());
        return v.is_boolean() ? v.get<bool>() : fallback;
      };
      const bool add_bos = flag("add_bos_token", true), add_eos = flag("add_eos_token", false);
      if ((!add_bos || bos) && (!add_eos || eos)) {
        template_prefix.clear();
        template_suffix.clear();
        if (add_bos) template_prefix.push_back(*bos);
        if (add_eos) template_suffix.push_back(*eos);
      }
    }
  }
}

void Tokenizer::Impl::parse_model(const Json& m) {
  const std::string type = m.value("type", std::string("BPE"));
  if (type != "BPE") unsupported("model", type, "BPE");
  if (!m.contains("vocab") || !m["vocab"].is_object()) malformed("model.vocab is not an object");
  if (!m.value("dropout", Json()).is_null() && m["dropout"].get<double>() != 0.0)
    unsupported("model", "BPE with dropout", "BPE without dropout");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const Json v = m.value(key, Json());
    if (v.is_string() && !v.get<std::string>().empty())
      unsupported("model", fmt::format("BPE with {}", key), "BPE without it");
  }
  std::int32_t max_id = -1;
  for (const auto& [tok, id] : m["vocab"].items()) {
    const std::int32_t i = token_id(id, fmt::format("model.vocab['{}']", tok));
    bpe.vocab.emplace(tok, i);
    max_id = std::max(max_id, i);
  }
  id_to_token.assign(static_cast<std::size_t>(max_id + 1), std::string());
  for (const auto& [tok, id] : bpe.vocab) id_to_token[id] = tok;
  build_char_ids();
  bpe.byte_fallback = m.value("byte_fallback", false);
  bpe.fuse_unk = m.value("fuse_unk", false);
  bpe.ignore_merges = m.value("ignore_merges", false);
  bpe.byte_ids.fill(-1);
  for (int b = 0; b < 256; ++b)
    if (auto it = bpe.vocab.find(fmt::format("<0x{:02X}>", b)); it != bpe.vocab.end())
      bpe.byte_ids[b] = it->second;
  if (const Json u = m.value("unk_token", Json()); u.is_string()) {
    auto it = bpe.vocab.find(u.get<std::string>());
    if (it == bpe.vocab.end())
      malformed(fmt::format("model.unk_token '{}' is not in the vocabulary", u.get<std::string>()));
    bpe.unk = it->second;
  }
  if (!m.contains("merges") || !m["merges"].is_array()) malformed("model.merges is not a list");
  bpe.merges.reserve(m["merges"].size());
  std::int32_t rank = 0;
  for (const Json& mj : m["merges"]) {
    std::string a, b;
    if (mj.is_string()) {
      const std::string s = mj.get<std::string>();
      const std::size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
        malformed(fmt::format("merge {} '{}' is not two tokens separated by one space", rank, s));
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else if (mj.is_array() && mj.size() == 2 && mj[0].is_string() && mj[1].is_string()) {
      a = mj[0].get<std::string>();
      b = mj[1].get<std::string>();
    } else {
      malformed(fmt::format("merge {} is neither \"a b\" nor [\"a\", \"b\"]", rank));
    }
    auto ia = bpe.vocab.find(a), ib = bpe.vocab.find(b), im = bpe.vocab.find(a + b);
    if (ia == bpe.vocab.end() || ib == bpe.vocab.end() || im == bpe.vocab.end())
      malformed(
          fmt::format("merge {} ('{}' '{}') names a token not in the vocabulary", rank, a, b));
    const std::uint64_t key =
        (static_cast<std::uint64_t>(ia->second) << 32) | static_cast<std::uint32_t>(ib->second);
    bpe.merges.insert(key, rank, im->second);  // the first (lowest) rank wins
    ++rank;
  }
}

void Tokenizer::Impl::parse_added(const Json& a) {
  if (!a.is_array()) malformed("added_tokens is not a list");
  for (const Json& t : a) {
    if (!t.is_object() || !t.contains("id") || !t.contains("content") || !t["content"].is_string())
      malformed("an added token lacks 'id' or 'content'");
    const std::string content = t["content"].get<std::string>();
    AddedToken at{content, token_id(t["id"], fmt::format("added_tokens '{}' id", content)),
                  t.value("special", false), t.value("lstrip", false), t.value("rstrip", false)};
    if (at.content.empty()) malformed("an added token is empty");
    if (t.value("single_word", false))
      unsupported("added token", fmt::format("'{}' with single_word", at.content),
                  "added tokens without single_word");
    if (static_cast<std::size_t>(at.id) >= id_to_token.size())
      id_to_token.resize(static_cast<std::size_t>(at.id) + 1);
    id_to_token[at.id] = at.content;
    added.push_back(std::move(at));
  }
  special.assign(id_to_token.size(), false);
  for (const AddedToken& t : added) special[t.id] = t.special;
  index_added();
}

void Tokenizer::Impl::build_char_ids() {
  std::size_t n = 0;
  for (const auto& [tok, id] : bpe.vocab) n += !tok.empty() && utf8_char_len(tok, 0) == tok.size();
  bpe.chars.reserve(n);
  for (const auto& [tok, id] : bpe.vocab)
    if (!tok.empty() && utf8_char_len(tok, 0) == tok.size()) bpe.chars.insert(char_key(tok), id, 0);
}

// Sorts the added tokens longest first and indexes them by their first byte, for encode's scan.
void Tokenizer::Impl::index_added() {
  std::stable_sort(added.begin(), added.end(), [](const AddedToken& x, const AddedToken& y) {
    return x.content.size() > y.content.size();
  });
  for (auto& v : added_by_first_byte) v.clear();
  for (std::size_t i = 0; i < added.size(); ++i)
    added_by_first_byte[static_cast<unsigned char>(added[i].content[0])].push_back(i);
}

// The fields of a SentencePiece model (a protobuf ModelProto) that say how it treats spaces, read
// by hand (Debian ships no header for the message): trainer_spec (2) model_type (3) and
// treat_whitespace_as_suffix (24); normalizer_spec (3) name (1), add_dummy_prefix (3),
// remove_extra_whitespaces (4), escape_whitespaces (5). Defaults as the .proto gives them.
struct SpmSpaces {
  std::uint64_t model_type = 1;  // 1 unigram, 2 BPE
  bool whitespace_as_suffix = false;
  std::string normalizer;
  bool add_dummy_prefix = true, remove_extra_whitespaces = true, escape_whitespaces = true;
  bool read = false;  // the message parsed
};

// Calls f(field number, varint value, length-delimited bytes) for each field of `buf`; false when
// the bytes are not a protobuf message.
template <class F>
bool for_each_field(std::string_view buf, F&& f) {
  std::size_t i = 0;
  const auto varint = [&](std::uint64_t& v) {
    v = 0;
    for (int shift = 0; shift < 64 && i < buf.size(); shift += 7) {
      const auto b = static_cast<unsigned char>(buf[i++]);
      v |= std::uint64_t(b & 0x7F) << shift;
      if (b < 0x80) return true;
    }
    return false;
  };
  while (i < buf.size()) {
    std::uint64_t key = 0, v = 0;
    if (!varint(key)) return false;
    std::string_view bytes;
    switch (key & 7) {
      case 0:
        if (!varint(v)) return false;
        break;
      case 1:
        if (buf.size() - i < 8) return false;
        i += 8;
        break;
      case 2:
        if (!varint(v) || v > buf.size() - i) return false;
        bytes = buf.substr(i, v);
        i += v;
        break;
      case 5:
        if (buf.size() - i < 4) return false;
        i += 4;
        break;
      default:
        return false;
    }
    f(key >> 3, v, bytes);
  }
  return true;
}

SpmSpaces read_spm_spaces(std::string_view model) {
  SpmSpaces s;
  s.read = for_each_field(model, [&](std::uint64_t num, std::uint64_t, std::string_view bytes) {
    if (num == 2)
      for_each_field(bytes, [&](std::uint64_t n, std::uint64_t v, std::string_view) {
        if (n == 3) s.model_type = v;
        if (n == 24) s.whitespace_as_suffix = v != 0;
      });
    if (num == 3)
      for_each_field(bytes, [&](std::uint64_t n, std::uint64_t v, std::string_view b) {
        if (n == 1) s.normalizer = std::string(b);
        if (n == 3) s.add_dummy_prefix = v != 0;
        if (n == 4) s.remove_extra_whitespaces = v != 0;
        if (n == 5) s.escape_whitespaces = v != 0;
      });
  });
  return s;
}

void Tokenizer::Impl::load_sentencepiece(std::string_view model, const Json& cj) {
  auto proc = std::make_unique<sentencepiece::SentencePieceProcessor>();
  if (const auto st = proc->LoadFromSerializedProto(model); !st.ok())
    STRATA_THROW(kInvalidArgument,
                 "{}: libsentencepiece cannot read it ({}); the file is not a SentencePiece "
                 "model — re-download tokenizer.model",
                 origin, st.ToString());
  const int n = proc->GetPieceSize();
  id_to_token.resize(static_cast<std::size_t>(n));
  special.assign(static_cast<std::size_t>(n), false);
  for (int id = 0; id < n; ++id) {
    id_to_token[id] = proc->IdToPiece(id);
    bpe.vocab.emplace(id_to_token[id], id);
    // Control symbols (<s>, </s>) and unk are special tokens written in text, as Hugging Face's
    // LlamaTokenizer has them; SentencePiece itself would spell them out character by character.
    if (proc->IsControl(id) || proc->IsUnknown(id)) {
      special[id] = true;
      if (!id_to_token[id].empty()) added.push_back({id_to_token[id], id, true, false, false});
    }
  }
  // added_tokens_decoder: {"32000": {"content": "<pad>", "special": true, ...}}. One inside the
  // model must be the model's piece at that id; one past it extends the vocabulary.
  if (cj.is_object() && cj.contains("added_tokens_decoder")) {
    const Json& atd = cj["added_tokens_decoder"];
    if (!atd.is_object())
      STRATA_THROW(kInvalidArgument,
                   "{}: tokenizer_config.json's added_tokens_decoder is not an object; fix or "
                   "remove the file",
                   origin);
    for (const auto& [key, t] : atd.items()) {
      long long parsed = -1;
      std::size_t used = 0;
      try {
        parsed = std::stoll(key, &used);
      } catch (const std::exception&) {
      }
      const std::string content = json_token(t);
      if (parsed < 0 || used != key.size() || content.empty())
        STRATA_THROW(kInvalidArgument,
                     "{}: tokenizer_config.json's added_tokens_decoder entry '{}' is not an id "
                     "with a content; fix or remove the file",
                     origin, key);
      // Ids past the model's pieces lie right after them, one per entry at most.
      const long long limit = static_cast<long long>(n) + static_cast<long long>(atd.size());
      if (parsed >= limit)
        STRATA_THROW(kInvalidArgument,
                     "{}: tokenizer_config.json's added_tokens_decoder id {} lies past the "
                     "model's {} pieces and its own {} entries; the files are from different "
                     "models",
                     origin, parsed, n, atd.size());
      const auto id = static_cast<std::int32_t>(parsed);
      if (t.value("single_word", false))
        unsupported("added token", fmt::format("'{}' with single_word", content),
                    "added tokens without single_word");
      if (id < n && id_to_token[id] != content)
        STRATA_THROW(kInvalidArgument,
                     "{}: tokenizer_config.json names '{}' as token {}, which tokenizer.model "
                     "spells '{}'; the two files are from different models",
                     origin, content, id, id_to_token[id]);
      if (static_cast<std::size_t>(id) >= id_to_token.size()) {
        id_to_token.resize(static_cast<std::size_t>(id) + 1);
        special.resize(id_to_token.size(), false);
      }
      id_to_token[id] = content;
      special[id] = t.value("special", false);
      std::erase_if(added, [&](const AddedToken& a) { return a.id == id; });
      added.push_back(
          {content, id, special[id], t.value("lstrip", false), t.value("rstrip", false)});
    }
  }
  index_added();
  // Decoding as Hugging Face's Llama tokenizer does: "▁" is a space, <0xXX> its byte, and the
  // first token loses the space the model put first (only when it puts one).
  decoder = DecoderKind::kPieces;
  decoder_replace.push_back(Replace{"\u2581", " "});
  decoder_byte_fallback = true;
  std::vector<std::string> probe;
  if (proc->Encode("a", &probe).ok() && !probe.empty() && probe[0].starts_with("\u2581"))
    decoder_strip_first = 1;
  // BOS / EOS / pad: tokenizer_config.json's names where it has the key, else the model's ids;
  // BOS put first unless add_bos_token says otherwise (LlamaTokenizer's default), EOS only with
  // add_eos_token.
  const Json config = cj.is_object() ? cj : Json::object();
  parse_config(config);
  const auto model_id = [](int id) {
    return id >= 0 ? std::optional<std::int32_t>(id) : std::nullopt;
  };
  if (!config.contains("bos_token")) bos = model_id(proc->bos_id());
  if (!config.contains("eos_token")) eos = model_id(proc->eos_id());
  if (!config.contains("pad_token")) pad = model_id(proc->pad_id());
  const auto flag = [&](const char* key, bool fallback) {
    const Json v = config.value(key, Json());
    return v.is_boolean() ? v.get<bool>() : fallback;
  };
  const bool add_bos = flag("add_bos_token", bos.has_value());
  const bool add_eos = flag("add_eos_token", false);
  if ((add_bos && !bos) || (add_eos && !eos))
    STRATA_THROW(kInvalidArgument,
                 "{}: tokenizer_config.json asks for add_{}_token but the model has no such "
                 "token; set it to false or name the token",
                 origin, add_bos && !bos ? "bos" : "eos");
  if (add_bos) template_prefix.push_back(*bos);
  if (add_eos) template_suffix.push_back(*eos);
  spm_legacy = flag("legacy", true);
  if (!spm_legacy) {
    spm_unk_text = proc->IdToPiece(proc->unk_id());
    std::vector<int> ids;
    if (!proc->Encode(spm_unk_text, &ids).ok())
      STRATA_THROW(kInternal, "{}: libsentencepiece cannot encode '{}'", origin, spm_unk_text);
    spm_legacy_skip = ids.size();
  }
  spm = std::move(proc);
  const SpmSpaces spaces = read_spm_spaces(model);
  find_metaspace_words();
  spm_split_words = split_before_metaspace && spaces.read && spaces.model_type == 2 &&
                    spaces.normalizer == "identity" && spaces.add_dummy_prefix &&
                    !spaces.remove_extra_whitespaces && spaces.escape_whitespaces &&
                    !spaces.whitespace_as_suffix;
  split_before_metaspace = false;  // that flag is the tokenizer.json path's
  if (spm_split_words) spm_metaspace_id = bpe.vocab.find(kMetaspace)->second;
}

void Tokenizer::Impl::spm_encode(std::string_view s, std::vector<std::int32_t>& out) const {
  thread_local std::vector<int> ids;
  ids.clear();
  if (const auto st = spm->Encode(s, &ids); !st.ok())
    STRATA_THROW(kInternal, "{}: libsentencepiece failed to encode a text: {}", origin,
                 st.ToString());
  out.insert(out.end(), ids.begin(), ids.end());
}

void Tokenizer::Impl::parse_normalizer(const Json& n) {
  if (n.is_null()) return;
  const std::string type = n.value("type", std::string());
  constexpr std::string_view kSupported =
      "NFC, NFD, NFKC, NFKD, Prepend, Replace (String), Sequence";
  if (type == "Sequence") {
    for (const Json& s : n.value("normalizers", Json::array())) parse_normalizer(s);
  } else if (type == "NFC") {
    normalizer.push_back(Nfx{static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE)});
  } else if (type == "NFD") {
    normalizer.push_back(Nfx{static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE)});
  } else if (type == "NFKC") {
    normalizer.push_back(
        Nfx{static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT)});
  } else if (type == "NFKD") {
    normalizer.push_back(Nfx{
        static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT)});
  } else if (type == "Prepend") {
    normalizer.push_back(Prepend{n.value("prepend", std::string())});
  } else if (type == "Replace") {
    const Json p = n.value("pattern", Json());
    if (!p.is_object() || !p.contains("String") || !p["String"].is_string())
      unsupported("normalizer", "Replace with a Regex pattern", kSupported);
    normalizer.push_back(
        Replace{p["String"].get<std::string>(), n.value("content", std::string())});
  } else {
    unsupported("normalizer", type, kSupported);
  }
}

void Tokenizer::Impl::parse_pre(const Json& p) {
  if (p.is_null()) return;
  const std::string type = p.value("type", std::string());
  constexpr std::string_view kSupported =
      "Split (Isolated, Removed), ByteLevel, Metaspace, Sequence";
  if (type == "Sequence") {
    for (const Json& s : p.value("pretokenizers", Json::array())) parse_pre(s);
  } else if (type == "Split") {
    const Json pat = p.value("pattern", Json());
    const std::string behavior = p.value("behavior", std::string());
    if (p.value("invert", false)) unsupported("pre_tokenizer", "Split with invert", kSupported);
    if (behavior != "Isolated" && behavior != "Removed")
      unsupported("pre_tokenizer", fmt::format("Split with behavior {}", behavior), kSupported);
    bool literal;
    std::string text;
    if (pat.is_object() && pat.contains("Regex") && pat["Regex"].is_string()) {
      literal = false;
      text = pat["Regex"].get<std::string>();
    } else if (pat.is_object() && pat.contains("String") && pat["String"].is_string()) {
      literal = true;
      text = pat["String"].get<std::string>();
    } else {
      malformed("a Split pre-tokenizer has no pattern {\"Regex\": ...} or {\"String\": ...}");
    }
    pre.push_back(Split{std::make_shared<Regex>(text, literal, origin), behavior == "Removed"});
  } else if (type == "ByteLevel") {
    std::shared_ptr<Regex> re;
    if (p.value("use_regex", true)) re = std::make_shared<Regex>(kGpt2Pattern, false, origin);
    pre.push_back(ByteLevelPre{p.value("add_prefix_space", false), std::move(re)});
  } else if (type == "Metaspace") {
    MetaspacePre ms{p.value("replacement", std::string("\u2581")), MetaspacePre::Prepend::kAlways,
                    p.value("split", true)};
    if (ms.replacement.empty()) malformed("a Metaspace pre-tokenizer has an empty replacement");
    if (p.contains("prepend_scheme")) {
      const std::string scheme = p.value("prepend_scheme", std::string());
      if (scheme == "first") {
        ms.prepend = MetaspacePre::Prepend::kFirst;
      } else if (scheme == "never") {
        ms.prepend = MetaspacePre::Prepend::kNever;
      } else if (scheme != "always") {
        malformed(
            fmt::format("Metaspace prepend_scheme '{}' is not always, first or never", scheme));
      }
    } else if (!p.value("add_prefix_space", true)) {
      ms.prepend = MetaspacePre::Prepend::kNever;
    }
    pre.push_back(std::move(ms));
  } else {
    unsupported("pre_tokenizer", type, kSupported);
  }
}

void Tokenizer::Impl::parse_post(const Json& p) {
  if (p.is_null()) return;
  const std::string type = p.value("type", std::string());
  if (type == "Sequence") {
    for (const Json& s : p.value("processors", Json::array())) parse_post(s);
  } else if (type == "ByteLevel") {
    // Offsets only: ids are untouched.
  } else if (type == "TemplateProcessing") {
    const Json single = p.value("single", Json());
    const Json specials = p.value("special_tokens", Json::object());
    if (!single.is_array()) malformed("TemplateProcessing has no 'single' list");
    bool seen_sequence = false;
    for (const Json& piece : single) {
      if (piece.contains("Sequence")) {
        seen_sequence = true;
      } else if (piece.contains("SpecialToken")) {
        const std::string name = piece["SpecialToken"].value("id", std::string());
        if (!specials.contains(name) || !specials[name].contains("ids"))
          malformed(fmt::format("TemplateProcessing names '{}' but special_tokens lacks it", name));
        auto& dst = seen_sequence ? template_suffix : template_prefix;
        for (const Json& id : specials[name]["ids"]) {
          const std::string where = fmt::format("post_processor.special_tokens['{}'].ids", name);
          const std::int32_t i = token_id(id, where);
          if (static_cast<std::size_t>(i) >= id_to_token.size())
            malformed(fmt::format("{} = {} is past the vocabulary's {} ids", where, i,
                                  id_to_token.size()));
          dst.push_back(i);
        }
      } else {
        malformed("a TemplateProcessing piece is neither Sequence nor SpecialToken");
      }
    }
  } else {
    unsupported("post_processor", type, "TemplateProcessing, ByteLevel, Sequence");
  }
}

void Tokenizer::Impl::parse_decoder(const Json& d) {
  constexpr std::string_view kSupported =
      "ByteLevel, Metaspace; a Sequence of Replace (String), ByteFallback, Fuse, Strip (leading), "
      "Metaspace";
  if (d.is_null()) unsupported("decoder", "null", kSupported);
  const std::string type = d.value("type", std::string());
  if (type == "ByteLevel") {
    decoder = DecoderKind::kByteLevel;
    return;
  }
  const auto metaspace = [&](const Json& s) {
    decoder_metaspace = s.value("replacement", std::string("\u2581"));
    const std::string scheme = s.value("prepend_scheme", std::string());
    decoder_metaspace_drop_first =
        s.contains("prepend_scheme") ? scheme != "never" : s.value("add_prefix_space", true);
  };
  decoder = DecoderKind::kPieces;
  if (type == "Metaspace") {
    metaspace(d);
    return;
  }
  if (type != "Sequence") unsupported("decoder", type, kSupported);
  bool fused = false;
  for (const Json& s : d.value("decoders", Json::array())) {
    const std::string t = s.value("type", std::string());
    if (t == "Metaspace") {
      if (fused) unsupported("decoder", "Metaspace after Fuse", kSupported);
      metaspace(s);
    } else if (t == "Replace") {
      const Json p = s.value("pattern", Json());
      if (!p.is_object() || !p.contains("String") || !p["String"].is_string())
        unsupported("decoder", "Replace with a Regex pattern", kSupported);
      decoder_replace.push_back(Replace{p["String"].get<std::string>(), s.value("content", "")});
    } else if (t == "ByteFallback") {
      decoder_byte_fallback = true;
    } else if (t == "Fuse") {
      fused = true;
    } else if (t == "Strip") {
      // After Fuse the text is one token: Strip takes `start` characters off its beginning.
      if (!fused || s.value("stop", 0) != 0 || s.value("content", std::string(" ")) != " ")
        unsupported("decoder", "Strip other than leading spaces after Fuse", kSupported);
      decoder_strip_first = s.value("start", 0);
    } else {
      unsupported("decoder", t, kSupported);
    }
  }
}

void Tokenizer::Impl::parse_config(const Json& c) {
  const auto resolve = [&](const char* key) -> std::optional<std::int32_t> {
    if (!c.contains(key) || c[key].is_null()) return std::nullopt;
    const std::string name = json_token(c[key]);
    STRATA_REQUIRE(!name.empty() || c[key].is_string(),
                   "{}: tokenizer_config.json's {} is {}, not a token: give the token's text "
                   "(\"</s>\", or {{\"content\": \"</s>\"}}), or null for none",
                   origin, key,
                   c[key].is_object()  ? "an object without a string \"content\""
                   : c[key].is_array() ? "an array"
                                       : c[key].dump());
    if (name.empty()) return std::nullopt;
    for (const AddedToken& t : added)
      if (t.content == name) return t.id;
    if (auto it = bpe.vocab.find(name); it != bpe.vocab.end()) return it->second;
    STRATA_THROW(kInvalidArgument,
                 "{}: tokenizer_config.json's {} '{}' is neither an added token nor in the "
                 "vocabulary of tokenizer.json; the two files are from different models",
                 origin, key, name);
  };
  bos = resolve("bos_token");
  eos = resolve("eos_token");
  pad = resolve("pad_token");
}

std::string Tokenizer::Impl::normalize(std::string s) const {
  for (const NormalizerStep& step : normalizer) {
    if (const auto* n = std::get_if<Nfx>(&step)) {
      utf8proc_uint8_t* out = nullptr;
      const utf8proc_ssize_t len =
          utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                       static_cast<utf8proc_ssize_t>(s.size()), &out, n->options);
      STRATA_CHECK(len >= 0, "utf8proc could not normalize valid UTF-8: {}", utf8proc_errmsg(len));
      s.assign(reinterpret_cast<const char*>(out), static_cast<std::size_t>(len));
      std::free(out);
    } else if (const auto* p = std::get_if<Prepend>(&step)) {
      if (!s.empty()) s = p->text + s;
    } else if (const auto* r = std::get_if<Replace>(&step)) {
      s = replace_all(std::move(s), r->from, r->to);
    }
  }
  return s;
}

std::vector<std::string> Tokenizer::Impl::pre_tokenize(std::string s, bool at_start) const {
  std::vector<std::string> pieces{std::move(s)};
  const auto split_by = [](const Regex& re, const std::vector<std::string>& in, bool removed) {
    std::vector<std::string> out;
    for (const std::string& piece : in) {
      std::size_t last = 0;
      for (auto [b, e] : re.find_all(piece)) {
        if (b > last) out.push_back(piece.substr(last, b - last));
        if (!removed) out.push_back(piece.substr(b, e - b));
        last = e;
      }
      if (last < piece.size()) out.push_back(piece.substr(last));
    }
    return out;
  };
  for (const PreStep& step : pre) {
    if (const auto* sp = std::get_if<Split>(&step)) {
      pieces = split_by(*sp->regex, pieces, sp->removed);
    } else if (const auto* bl = std::get_if<ByteLevelPre>(&step)) {
      if (bl->add_prefix_space)
        for (std::string& p : pieces)
          if (p.empty() || p[0] != ' ') p.insert(0, " ");
      if (bl->regex) pieces = split_by(*bl->regex, pieces, false);
      const ByteMap& bm = byte_map();
      for (std::string& p : pieces) {
        std::string mapped;
        mapped.reserve(p.size() * 2);
        for (unsigned char c : p) mapped += bm.to_char[c];
        p = std::move(mapped);
      }
    } else if (const auto* ms = std::get_if<MetaspacePre>(&step)) {
      std::vector<std::string> out;
      for (std::size_t k = 0; k < pieces.size(); ++k) {
        std::string p = replace_all(std::move(pieces[k]), " ", ms->replacement);
        const bool prepend = ms->prepend == MetaspacePre::Prepend::kAlways ||
                             (ms->prepend == MetaspacePre::Prepend::kFirst && at_start && k == 0);
        if (prepend && !p.starts_with(ms->replacement)) p.insert(0, ms->replacement);
        if (!ms->split) {
          out.push_back(std::move(p));
          continue;
        }
        // Each replacement begins a piece (merged with what follows it).
        std::size_t begin = 0;
        for (std::size_t hit = p.find(ms->replacement, 1); hit != std::string::npos;
             hit = p.find(ms->replacement, hit + ms->replacement.size())) {
          if (hit > begin) out.push_back(p.substr(begin, hit - begin));
          begin = hit;
        }
        if (begin < p.size()) out.push_back(p.substr(begin));
      }
      pieces = std::move(out);
    }
  }
  return pieces;
}

// Words seen before on this thread, with their ids: most of a text's words recur, and merging is
// the costly step. The cache belongs to one tokenizer at a time (its serial) and is bounded.
struct WordCache {
  std::uint64_t owner = 0;
  std::unordered_map<std::string, std::vector<std::int32_t>, StringHash, std::equal_to<>> words;
};
constexpr std::size_t kWordCacheMaxWord = 64, kWordCacheMaxWords = 1 << 16;

// Appends the ids of word `w` to `out`: from this thread's cache, else compute(w, out), cached.
template <class Compute>
void cached_word(std::uint64_t owner, std::string_view w, std::vector<std::int32_t>& out,
                 Compute&& compute) {
  if (w.size() > kWordCacheMaxWord) return compute(w, out);
  thread_local WordCache cache;
  if (cache.owner != owner) {
    cache.words.clear();
    cache.owner = owner;
  }
  if (auto it = cache.words.find(w); it != cache.words.end()) {
    out.insert(out.end(), it->second.begin(), it->second.end());
    return;
  }
  const std::size_t before = out.size();
  compute(w, out);
  if (cache.words.size() >= kWordCacheMaxWords) cache.words.clear();
  cache.words.emplace(std::string(w), std::vector<std::int32_t>(out.begin() + before, out.end()));
}

void Tokenizer::Impl::bpe_word(std::string_view w, std::vector<std::int32_t>& out) const {
  if (w.empty()) return;
  cached_word(serial, w, out,
              [this](std::string_view x, std::vector<std::int32_t>& o) { merge_word(x, o); });
}

void Tokenizer::Impl::spm_words(std::string_view span, std::vector<std::int32_t>& out) const {
  // Cut before each space (or "▁") that follows another character. The first part is encoded as
  // the library would the span (it puts "▁" first); each later one begins with its space, which
  // is the "▁" the library puts first when given the rest: " world" is encoded as "world".
  const auto later = [this](std::string_view part, std::vector<std::int32_t>& o) {
    const std::size_t n = part.front() == ' ' ? 1 : kMetaspace.size();
    if (part.size() == n) {
      o.push_back(spm_metaspace_id);
    } else {
      spm_encode(part.substr(n), o);
    }
  };
  std::size_t begin = 0;
  bool after_space = true;
  for (std::size_t i = 0; i < span.size();) {
    const std::size_t n = span[i] == ' '                           ? 1
                          : span.substr(i).starts_with(kMetaspace) ? kMetaspace.size()
                                                                   : 0;
    if (n == 0) {
      after_space = false;
      i += std::max<std::size_t>(1, utf8_char_len(span, i));
      continue;
    }
    if (!after_space) {
      if (begin == 0) {
        spm_encode(span.substr(0, i), out);
      } else {
        cached_word(serial, span.substr(begin, i - begin), out, later);
      }
      begin = i;
    }
    after_space = true;
    i += n;
  }
  if (begin == 0) {
    spm_encode(span, out);
  } else {
    cached_word(serial, span.substr(begin), out, later);
  }
}

void Tokenizer::Impl::merge_word(std::string_view w, std::vector<std::int32_t>& out) const {
  if (bpe.ignore_merges)
    if (auto it = bpe.vocab.find(w); it != bpe.vocab.end()) {
      out.push_back(it->second);
      return;
    }
  std::vector<std::int32_t> syms;
  bool last_unk = false;
  for (std::size_t i = 0; i < w.size();) {
    const std::size_t n = std::max<std::size_t>(1, utf8_char_len(w, i));
    const std::string_view ch = w.substr(i, n);
    i += n;
    if (const auto* c = bpe.chars.find(char_key(ch))) {
      syms.push_back(c->first);
      last_unk = false;
      continue;
    }
    if (bpe.byte_fallback && std::all_of(ch.begin(), ch.end(), [&](char c) {
          return bpe.byte_ids[static_cast<unsigned char>(c)] >= 0;
        })) {
      for (char c : ch) syms.push_back(bpe.byte_ids[static_cast<unsigned char>(c)]);
      last_unk = false;
      continue;
    }
    if (!bpe.unk)
      STRATA_THROW(kInvalidArgument,
                   "{}: the character '{}' is not in the vocabulary and the BPE model has no "
                   "unk_token nor byte fallback for it; this text cannot be encoded with this "
                   "tokenizer",
                   origin, ch);
    if (!(bpe.fuse_unk && last_unk)) syms.push_back(*bpe.unk);
    last_unk = true;
  }
  // Merge the lowest-ranked adjacent pair, leftmost first, until no pair has a merge: a min-heap
  // of candidate merges over a linked list of symbols, O(n log n) — a piece can be a whole line
  // (Llama 2 has no pre-tokenizer). A popped candidate whose symbols have changed since it was
  // pushed no longer forms its merged token and is dropped, as Hugging Face's BPE does.
  struct Sym {
    std::int32_t id;
    std::int32_t prev, next;  // -1 at the ends
    bool alive;
  };
  struct Candidate {
    std::int32_t rank, pos, new_id;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  const auto n = static_cast<std::int32_t>(syms.size());
  std::vector<Sym> list(syms.size());
  for (std::int32_t i = 0; i < n; ++i) list[i] = {syms[i], i - 1, i + 1 < n ? i + 1 : -1, true};
  const auto lookup = [&](std::int32_t a, std::int32_t b) {
    return bpe.merges.find((static_cast<std::uint64_t>(a) << 32) | static_cast<std::uint32_t>(b));
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
  const auto push = [&](std::int32_t pos) {
    const std::int32_t next = list[pos].next;
    if (next < 0) return;
    if (const auto* m = lookup(list[pos].id, list[next].id)) heap.push({m->first, pos, m->second});
  };
  for (std::int32_t i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    Sym& left = list[c.pos];
    if (!left.alive || left.next < 0) continue;
    const auto* m = lookup(left.id, list[left.next].id);
    if (m == nullptr || m->second != c.new_id) continue;
    Sym& right = list[left.next];
    left.id = c.new_id;
    right.alive = false;
    left.next = right.next;
    if (left.next >= 0) list[left.next].prev = c.pos;
    if (left.prev >= 0) push(left.prev);
    push(c.pos);
  }
  for (std::int32_t i = 0; i >= 0 && i < n; i = list[i].next) out.push_back(list[i].id);
}

void Tokenizer::Impl::encode_span(std::string_view span, bool at_start,
                                  std::vector<std::int32_t>& out) const {
  if (span.empty()) return;
  if (spm) {
    if (spm_legacy || at_start)
      return spm_split_words ? spm_words(span, out) : spm_encode(span, out);
    const std::size_t before = out.size();
    spm_encode(spm_unk_text + std::string(span), out);
    out.erase(
        out.begin() + static_cast<std::ptrdiff_t>(before),
        out.begin() + static_cast<std::ptrdiff_t>(std::min(before + spm_legacy_skip, out.size())));
    return;
  }
  const std::string norm = normalize(std::string(span));
  if (norm.empty()) return;
  for (const std::string& piece : pre_tokenize(norm, at_start)) {
    if (!split_before_metaspace) {
      bpe_word(piece, out);
      continue;
    }
    const std::string_view v(piece);
    std::size_t begin = 0;
    for (std::size_t hit = v.find(kMetaspace, 1); hit != std::string_view::npos;
         hit = v.find(kMetaspace, hit + kMetaspace.size())) {
      if (hit >= kMetaspace.size() &&
          v.substr(hit - kMetaspace.size(), kMetaspace.size()) == kMetaspace)
        continue;  // a run of them stays one word
      bpe_word(v.substr(begin, hit - begin), out);
      begin = hit;
    }
    bpe_word(v.substr(begin), out);
  }
}

void Tokenizer::Impl::find_metaspace_words() {
  split_before_metaspace = false;
  if (bpe.ignore_merges || !bpe.vocab.contains(kMetaspace)) return;
  for (const auto& [tok, id] : bpe.vocab) {
    std::string_view t(tok);
    while (t.starts_with(kMetaspace)) t.remove_prefix(kMetaspace.size());
    if (t.find(kMetaspace) != std::string_view::npos) return;
  }
  split_before_metaspace = true;
}

static std::uint64_t next_tokenizer_serial() {
  static std::atomic<std::uint64_t> next{1};
  return next.fetch_add(1);
}

namespace {
// tokenizer_config.json's text (may be empty: a null Json), read for the tokenizer `origin`.
Json parse_config_json(std::string_view text, const std::string& origin) {
  if (text.empty()) return Json();
  STRATA_REQUIRE(!config::nested_too_deep(text),
                 "{}: tokenizer_config.json nests arrays and objects more than {} deep; fix or "
                 "remove the file",
                 origin, config::kMaxJsonDepth);
  try {
    return Json::parse(text);
  } catch (const Json::exception& e) {
    STRATA_THROW(kInvalidArgument,
                 "{}: tokenizer_config.json does not parse ({}); fix or remove the file", origin,
                 e.what());
  }
}
}  // namespace

Tokenizer Tokenizer::from_json(std::string_view tokenizer_json, std::string_view config_json,
                               std::string origin) {
  auto impl = std::make_shared<Impl>();
  impl->origin = std::move(origin);
  Json tj, cj;
  if (config::nested_too_deep(tokenizer_json))
    impl->malformed(
        fmt::format("arrays and objects nested more than {} deep", config::kMaxJsonDepth));
  try {
    tj = Json::parse(tokenizer_json);
  } catch (const Json::exception& e) {
    impl->malformed(fmt::format("JSON does not parse ({})", e.what()));
  }
  cj = parse_config_json(config_json, impl->origin);
  try {
    impl->parse(tj, cj);
  } catch (const Json::exception& e) {
    impl->malformed(fmt::format("a field has the wrong type ({})", e.what()));
  }
  if (impl->special.size() < impl->id_to_token.size())
    impl->special.resize(impl->id_to_token.size());
  impl->find_metaspace_words();
  impl->serial = next_tokenizer_serial();
  return Tokenizer(std::move(impl));
}

std::filesystem::path Tokenizer::file_in(const std::filesystem::path& dir) {
  std::error_code ec;
  for (const char* name : {"tokenizer.json", "tokenizer.model"})
    if (std::filesystem::is_regular_file(dir / name, ec)) return dir / name;
  return {};
}

Tokenizer Tokenizer::from_folder(const std::filesystem::path& dir) {
  const auto read = [](const std::filesystem::path& p) {
    require_input_file("", p.string());  // a folder or a pipe of that name: said
    std::ifstream f(p, std::ios::binary);
    if (!f)
      detail::throw_errno(
          __FILE__, __LINE__, "open", errno,
          fmt::format("cannot read {}: check the path and permissions", p.string()));
    std::stringstream ss;
    ss << f.rdbuf();
    std::string text = ss.str();
    const std::string kind = foreign_file_kind(std::string_view(text).substr(0, 64));
    STRATA_REQUIRE(kind.empty(), "{} {}", p.string(), kind);
    return text;
  };
  const std::filesystem::path tj = dir / "tokenizer.json", cj = dir / "tokenizer_config.json",
                              sp = dir / "tokenizer.model";
  std::string config;
  if (std::filesystem::exists(cj)) config = read(cj);
  if (std::filesystem::exists(tj)) return from_json(read(tj), config, tj.string());
  if (std::filesystem::exists(sp)) return from_sentencepiece(read(sp), config, sp.string());
  STRATA_THROW(kInvalidArgument,
               "{}: neither tokenizer.json nor tokenizer.model in the folder; pass a Hugging "
               "Face model folder that has one",
               dir.string());
}

Tokenizer Tokenizer::from_sentencepiece(std::string_view model, std::string_view config_json,
                                        std::string origin) {
  auto impl = std::make_shared<Impl>();
  impl->origin = std::move(origin);
  Json cj;
  cj = parse_config_json(config_json, impl->origin);
  try {
    impl->load_sentencepiece(model, cj);
    impl->serial = next_tokenizer_serial();
  } catch (const Json::exception& e) {
    STRATA_THROW(kInvalidArgument,
                 "{}: tokenizer_config.json has a field of the wrong type ({}); fix or remove "
                 "the file",
                 impl->origin, e.what());
  }
  return Tokenizer(std::move(impl));
}

std::vector<std::int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  const Impl& m = *impl_;
  const std::size_t bad = utf8::first_invalid(text);
  STRATA_REQUIRE(bad == std::string_view::npos,
                 "encode: the text is not valid UTF-8 at byte {}; pass UTF-8 text", bad);
  std::vector<std::int32_t> out;
  if (add_special_tokens) out = m.template_prefix;
  // Added tokens first, leftmost-longest; the text between them goes through the pipeline.
  std::size_t span_begin = 0;
  for (std::size_t i = 0; i < text.size();) {
    const AddedToken* hit = nullptr;
    for (std::size_t k : m.added_by_first_byte[static_cast<unsigned char>(text[i])]) {
      if (text.substr(i).starts_with(m.added[k].content)) {
        hit = &m.added[k];
        break;  // longest first
      }
    }
    if (hit == nullptr) {
      ++i;
      continue;
    }
    std::size_t b = i, e = i + hit->content.size();
    if (hit->lstrip)
      for (std::size_t n; (n = space_before(text, span_begin, b)) > 0;) b -= n;
    if (hit->rstrip)
      for (std::size_t n; (n = space_at(text, e)) > 0;) e += n;
    m.encode_span(text.substr(span_begin, b - span_begin), span_begin == 0, out);
    out.push_back(hit->id);
    span_begin = i = e;
  }
  m.encode_span(text.substr(span_begin), span_begin == 0, out);
  if (add_special_tokens) out.insert(out.end(), m.template_suffix.begin(), m.template_suffix.end());
  return out;
}

std::string Tokenizer::token_bytes(std::int32_t id, bool first) const {
  const Impl& m = *impl_;
  const std::string& tok = id_to_token(id);
  if (m.decoder == DecoderKind::kByteLevel) {
    // Every character through the byte map; a token with a character outside it (an added
    // token in plain UTF-8) is its own text.
    const ByteMap& bm = byte_map();
    std::string out;
    for (std::size_t i = 0; i < tok.size();) {
      const std::size_t n = std::max<std::size_t>(1, utf8_char_len(tok, i));
      auto it = bm.to_byte.find(tok.substr(i, n));
      if (it == bm.to_byte.end()) return tok;
      out.push_back(static_cast<char>(it->second));
      i += n;
    }
    return out;
  }
  std::string s = tok;
  for (const Replace& r : m.decoder_replace) s = replace_all(std::move(s), r.from, r.to);
  if (!m.decoder_metaspace.empty())
    s = replace_all(std::move(s), m.decoder_metaspace,
                    first && m.decoder_metaspace_drop_first ? "" : " ");
  if (m.decoder_byte_fallback && s.size() == 6 && s.starts_with("<0x") && s[5] == '>') {
    unsigned v = 0;
    if (std::sscanf(s.c_str() + 3, "%2X", &v) == 1) s.assign(1, static_cast<char>(v));
  }
  if (first) {
    std::size_t k = 0;
    while (k < m.decoder_strip_first && k < s.size() && s[k] == ' ') ++k;
    s.erase(0, k);
  }
  return s;
}

std::string Tokenizer::decode(std::span<const std::int32_t> ids, bool skip_special_tokens,
                              bool continues) const {
  std::string bytes;
  bool first = !continues;
  for (std::int32_t id : ids) {
    if (skip_special_tokens && is_special(id)) continue;
    bytes += token_bytes(id, first);
    first = false;
  }
  return utf8::lossy(bytes);
}

std::int32_t Tokenizer::vocab_size() const {
  return static_cast<std::int32_t>(impl_->id_to_token.size());
}

const std::string& Tokenizer::id_to_token(std::int32_t id) const {
  STRATA_REQUIRE(id >= 0 && id < vocab_size(),
                 "token id {} is outside the tokenizer's vocabulary [0, {}); the ids come from "
                 "another model",
                 id, vocab_size());
  return impl_->id_to_token[static_cast<std::size_t>(id)];
}

std::optional<std::int32_t> Tokenizer::token_to_id(std::string_view token) const {
  for (const AddedToken& t : impl_->added)
    if (t.content == token) return t.id;
  if (auto it = impl_->bpe.vocab.find(std::string(token)); it != impl_->bpe.vocab.end())
    return it->second;
  return std::nullopt;
}

bool Tokenizer::is_special(std::int32_t id) const {
  return id >= 0 && static_cast<std::size_t>(id) < impl_->special.size() &&
         impl_->special[static_cast<std::size_t>(id)];
}

std::optional<std::int32_t> Tokenizer::bos_id() const { return impl_->bos; }
std::optional<std::int32_t> Tokenizer::eos_id() const { return impl_->eos; }
std::optional<std::int32_t> Tokenizer::pad_id() const { return impl_->pad; }
std::size_t first_invalid_utf8(std::string_view text) { return utf8::first_invalid(text); }

bool Tokenizer::adds_bos() const {
  return !impl_->template_prefix.empty() &&
         (!impl_->bos || impl_->template_prefix.front() == *impl_->bos);
}

std::string TokenStreamDecoder::push(std::int32_t id) {
  if (skip_special_ && tok_->is_special(id)) return {};
  pending_ += tok_->token_bytes(id, first_);
  first_ = false;
  // Hand out everything but a character still cut off at the end.
  std::size_t keep = 0;
  for (std::size_t i = 0; i < pending_.size();) {
    const std::size_t n = utf8_char_len(pending_, i);
    if (n > 0) {
      i += n;
      continue;
    }
    const std::size_t tail = utf8_incomplete_tail(pending_, i);
    if (tail > 0 && i + tail == pending_.size()) {
      keep = tail;
      break;
    }
    ++i;
  }
  std::string out = utf8::lossy(std::string_view(pending_).substr(0, pending_.size() - keep));
  pending_.erase(0, pending_.size() - keep);
  return out;
}

std::string TokenStreamDecoder::finish() {
  std::string out = utf8::lossy(pending_);
  pending_.clear();
  return out;
}

}  // namespace strata
