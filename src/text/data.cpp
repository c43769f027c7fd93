// Token files (mmap) and the llm.c-exact / shuffled micro-batch loader.
//
// Invariant: a file's split is a token range [begin, end) fixed at open; unshuffled batches
// walk it exactly as llm.c's dataloader.h does, shuffled ones walk a permutation of its
// T+1-token windows. Each epoch's permutation is drawn afresh from the canonical window order
// with a generator seeded by (seed, epoch), so it depends on nothing else: reset() and a resume
// that replays next() see the same batches. It is our own Fisher-Yates over mt19937_64, so a
// seed gives the same order with every standard library.
#include <fcntl.h>
#include <fmt/ranges.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "core/file_kind.h"
#include "strata/corpus.h"
#include "strata/error.h"
#include "strata/log.h"
#include "strata/model_data.h"
#include "text/mapped_file.h"

namespace strata {
namespace {

constexpr std::int32_t kLlmcMagic = 20240520;
constexpr std::size_t kLlmcHeaderBytes = 256 * 4;

struct TokenFile {
  std::string path;
  const std::uint8_t* base = nullptr;
  std::size_t size = 0;
  std::size_t data_offset = 0;      // bytes before the first id
  std::size_t elem = 2;             // bytes per id
  std::int64_t begin = 0, end = 0;  // this split's token range

  ~TokenFile() { text::unmap_data_file(base, size); }
  std::int64_t id(std::int64_t i) const {
    const std::uint8_t* p = base + data_offset + std::size_t(i) * elem;
    if (elem == 1) return *p;
    if (elem == 2) {
      std::uint16_t v;
      std::memcpy(&v, p, 2);
      return v;
    }
    std::uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
  }
};

// The bytes a text sniff reads: a token file's first ids are as good a sample as any.
constexpr std::size_t kSniffBytes = 4096;

// True when the first kSniffBytes of [p, p + n) are text: printable ASCII, tabs, line ends and
// well-formed UTF-8 (a sequence the sample cuts short counts). Token ids read as bytes are not:
// ids below 0x2000 (most of any vocabulary) give bytes below 0x20 in every uint16 and uint32.
bool looks_like_text(const std::uint8_t* p, std::size_t n) {
  n = std::min(n, kSniffBytes);
  if (n == 0) return false;
  for (std::size_t i = 0; i < n;) {
    const std::uint8_t c = p[i];
    if (c == '\t' || c == '\n' || c == '\r' || (c >= 0x20 && c < 0x7f)) {
      ++i;
      continue;
    }
    const std::size_t len = c >= 0xc2 && c <= 0xdf   ? 2
                            : c >= 0xe0 && c <= 0xef ? 3
                            : c >= 0xf0 && c <= 0xf4 ? 4
                                                     : 0;
    if (len == 0) return false;
    for (std::size_t k = 1; k < len; ++k)
      if (i + k < n && (p[i + k] & 0xc0) != 0x80) return false;
    i += len;
  }
  return true;
}

// A text file where token ids are read would train on its bytes taken as ids: garbage, silently.
void refuse_text(const TokenFile& f, const char* read_as) {
  if (!looks_like_text(f.base, f.size)) return;
  std::size_t i = 0;
  while (i < f.size && (f.base[i] == ' ' || f.base[i] == '\n' || f.base[i] == '\r')) ++i;
  const bool jsonl = i < f.size && f.base[i] == '{';
  STRATA_THROW(
      kInvalidArgument,
      "{}: this is {}, not token ids (its first {} bytes are all UTF-8 text), so reading "
      "it as {} would train on characters taken for ids. strata-train reads token files "
      "(an llm.c .bin, or raw uint16 / uint32 ids: --data-dtype u16|u32) and prepared "
      "files: tokenize it with the model's own tokenizer (strata-prep --model DIR FILE "
      "-o FILE.prep; strata-train --data FILE with --data-dtype auto and a --model folder "
      "that has tokenizer.json does it for .txt and JSON lines: .jsonl, .json); a byte-level model "
      "(vocab_size 256) trains on a text file with --text",
      f.path, jsonl ? "JSON lines text" : "text", std::min(f.size, kSniffBytes), read_as);
}

// `vocab_size` (0 = unknown) keeps kAuto from reading ids it cannot hold as uint16.
std::unique_ptr<TokenFile> open_tokens(const std::string& path, TokenFormat fmt,
                                       std::int64_t vocab_size) {
  auto f = std::make_unique<TokenFile>();
  f->path = path;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    detail::throw_errno(__FILE__, __LINE__, "open", errno,
                        fmt::format("cannot open token file {}", path));
  struct stat st {};
  ::fstat(fd, &st);
  f->size = static_cast<std::size_t>(st.st_size);
  if (f->size > 0) {
    try {
      f->base = text::map_data_file(fd, f->size, path);
    } catch (...) {
      ::close(fd);
      throw;
    }
  }
  ::close(fd);
  std::int32_t head[3] = {0, 0, 0};
  if (f->size >= 12) std::memcpy(head, f->base, 12);
  if (fmt == TokenFormat::kAuto) {
    if (head[0] == kLlmcMagic)
      fmt = TokenFormat::kLlmc;
    else if (is_text_corpus_file(path))
      fmt = TokenFormat::kBytes;
    else
      fmt = TokenFormat::kU16;
    if (fmt == TokenFormat::kU16) {
      const std::string kind = foreign_file_kind(std::string_view(
          reinterpret_cast<const char*>(f->base), std::min<std::size_t>(f->size, 64)));
      // (Raw ids can begin with those bytes too: their width is the other way out.)
      STRATA_REQUIRE(kind.empty(),
                     "{} {} (if it holds raw token ids instead, give their width with "
                     "--data-dtype u16 or u32)",
                     path, kind);
      refuse_text(*f, "raw token ids (no header, not .txt)");
      // Raw ids say nothing of their width: read as uint16, uint32 ids (or anything else) train
      // silently on garbage.
      STRATA_THROW(kInvalidArgument,
                   "{}: no header (not a strata-prep file, not an llm.c .bin) and not .txt, so "
                   "its format is unknown: give raw token ids' width with --data-dtype u16 or "
                   "u32{} (it applies to --data and --eval-data alike: give both in one format), "
                   "or prepare the corpus with strata-prep",
                   path,
                   vocab_size > 65536
                       ? fmt::format(" (this model's vocab_size {} needs u32)", vocab_size)
                       : std::string());
    }
  }
  std::size_t ntok = 0;
  switch (fmt) {
    case TokenFormat::kBytes:
      // Bytes are ids 0-255: a model with a larger vocabulary would train on them as its own
      // tokens (a Llama's 128k), and say nothing.
      STRATA_REQUIRE(vocab_size == 0 || vocab_size <= 256,
                     "{}: text is read byte by byte (ids 0-255: --text, a .txt file or "
                     "--data-dtype bytes), which only a byte-level model reads, but this model's "
                     "vocab_size is {}: tokenize it with the model's own tokenizer (--model DIR "
                     "whose folder has tokenizer.json prepares .txt and .jsonl with it; or "
                     "strata-prep --model DIR, then --data FILE.prep)",
                     path, vocab_size);
      f->elem = 1;
      ntok = f->size;
      break;
    case TokenFormat::kU16:
    case TokenFormat::kU32:
      // An llm.c file read raw would take its header for tokens (and a v2 file's uint32 ids
      // for pairs of uint16 ones): garbage, silently.
      STRATA_REQUIRE(f->size < 8 || std::memcmp(f->base, kPreparedMagic, 8) != 0,
                     "{}: a prepared file (strata-prep's magic STRATAPD), not raw {} ids; give "
                     "the format auto or prepared (strata-train --data-dtype auto)",
                     path, fmt == TokenFormat::kU16 ? "uint16" : "uint32");
      STRATA_REQUIRE(head[0] != kLlmcMagic,
                     "{}: starts with the llm.c magic {}, so it is an llm.c token file, not raw {} "
                     "ids; give the "
                     "format auto or llmc (strata-train --data-dtype auto), which read its header",
                     path, kLlmcMagic, fmt == TokenFormat::kU16 ? "uint16" : "uint32");
      refuse_text(*f, fmt == TokenFormat::kU16 ? "uint16 ids" : "uint32 ids");
      f->elem = fmt == TokenFormat::kU16 ? 2 : 4;
      STRATA_REQUIRE(f->size % f->elem == 0,
                     "{}: {} bytes is not a whole number of {}-byte token ids (truncated?)", path,
                     f->size, f->elem);
      ntok = f->size / f->elem;
      break;
    case TokenFormat::kLlmc: {
      STRATA_REQUIRE(head[0] == kLlmcMagic,
                     "{}: not an llm.c token file (needs a {}-byte header starting with magic {}; "
                     "found {} at offset 0)",
                     path, kLlmcHeaderBytes, kLlmcMagic, head[0]);
      STRATA_REQUIRE(f->size >= kLlmcHeaderBytes,
                     "{}: truncated: an llm.c token file's header is {} bytes, the file has {}",
                     path, kLlmcHeaderBytes, f->size);
      STRATA_REQUIRE(
          head[1] == 1 || head[1] == 2,
          "{}: llm.c header version {} at offset 4 is not 1 (uint16 ids) or 2 (uint32 ids)", path,
          head[1]);
      f->elem = head[1] == 1 ? 2 : 4;
      f->data_offset = kLlmcHeaderBytes;
      STRATA_REQUIRE(head[2] >= 0, "{}: the llm.c header's token count (offset 8) is {}: damaged",
                     path, head[2]);
      STRATA_REQUIRE(kLlmcHeaderBytes + std::size_t(head[2]) * f->elem <= f->size,
                     "{}: truncated: the header (offset 8) promises {} tokens = {} bytes after "
                     "offset {}, the file "
                     "has {} bytes",
                     path, head[2], std::size_t(head[2]) * f->elem, kLlmcHeaderBytes, f->size);
      ntok = static_cast<std::size_t>(head[2]);
      break;
    }
    case TokenFormat::kAuto:
    case TokenFormat::kPrepared:
      break;
  }
  f->end = static_cast<std::int64_t>(ntok);
  return f;
}

}  // namespace

TokenFormat parse_token_format(const std::string& name) {
  if (name == "auto") return TokenFormat::kAuto;
  if (name == "u16") return TokenFormat::kU16;
  if (name == "u32") return TokenFormat::kU32;
  if (name == "llmc") return TokenFormat::kLlmc;
  if (name == "bytes") return TokenFormat::kBytes;
  if (name == "prepared") return TokenFormat::kPrepared;
  STRATA_THROW(kInvalidArgument,
               "token format '{}' is not one of auto, u16, u32, llmc, bytes, prepared", name);
}

namespace {

void check_options(const DataOptions& o) {
  STRATA_REQUIRE(!o.files.empty(), "TokenLoader: no token files given");
  STRATA_REQUIRE(o.batch > 0 && o.seq_len > 0,
                 "TokenLoader: batch ({}) and seq_len ({}) must be > 0", o.batch, o.seq_len);
  STRATA_REQUIRE(o.val_fraction >= 0 && o.val_fraction < 1,
                 "TokenLoader: val_fraction {} must be in [0, 1)", o.val_fraction);
}

// The file's token range cut to `split`: the last val_fraction of its tokens are validation.
void cut_split(TokenFile& f, double val_fraction, DataSplit split) {
  const std::int64_t ntok = f.end;
  const std::int64_t cut = ntok - static_cast<std::int64_t>(double(ntok) * val_fraction);
  if (split == DataSplit::kTrain)
    f.end = cut;
  else
    f.begin = cut;
}

// The sequences of T tokens an epoch gives from `f`'s split: shuffled, its T+1-token windows at a
// stride of T; unshuffled, B per batch of B*T+1 tokens at a stride of B*T (the loaders' walks).
std::int64_t rows_of(const TokenFile& f, const DataOptions& o) {
  const std::int64_t len = f.end - f.begin;
  const std::int64_t unit = o.shuffle ? o.seq_len : o.batch * o.seq_len;
  if (len < unit + 1) return 0;
  return (len - 1) / unit * (o.shuffle ? 1 : o.batch);
}

// ---- prepared files: documents packed into rows ----

// A row: tokens [begin, end) of file `file` (a whole row or less, then padded).
struct PackedRow {
  std::uint32_t file;
  std::int64_t begin, end;
};

struct PackedFiles {
  std::vector<std::unique_ptr<PreparedFile>> files;
  std::vector<PackedRow> rows;
  DataExtent extent;
};

bool any_prepared(const DataOptions& o) {
  bool any = false, all = true;
  for (const auto& path : o.files) {
    const bool p = o.format == TokenFormat::kPrepared ||
                   (o.format == TokenFormat::kAuto && is_prepared_file(path));
    any |= p;
    all &= p;
  }
  STRATA_REQUIRE(!any || all,
                 "the data files mix prepared files (strata-prep) and token files: give one kind "
                 "(prepare them all with strata-prep)");
  return any;
}

// The documents [d0, d1) of `f` packed into rows of T: consecutive documents share a row while
// they fit; one that does not starts the next row; one longer than T starts a row and is cut in
// pieces of T (counted in `split`).
void pack(const PreparedFile& f, std::uint32_t fi, std::int64_t d0, std::int64_t d1, std::int64_t T,
          std::vector<PackedRow>& rows, std::int64_t& split) {
  std::int64_t open = -1, fill = 0;  // the row being filled: its first token and length
  auto close = [&] {
    if (open >= 0) rows.push_back({fi, open, open + fill});
    open = -1;
    fill = 0;
  };
  for (std::int64_t d = d0; d < d1; ++d) {
    const std::int64_t b = f.doc_start(d), e = f.doc_start(d + 1), len = e - b;
    if (len > T) {
      close();
      ++split;
      std::int64_t p = b;
      for (; e - p >= T; p += T) rows.push_back({fi, p, p + T});
      if (p < e) {
        open = p;
        fill = e - p;
      }
    } else if (open >= 0 && fill + len <= T) {
      fill += len;
    } else {
      close();
      open = b;
      fill = len;
    }
  }
  close();
}

PackedFiles open_packed(const DataOptions& o, DataSplit split) {
  PackedFiles pf;
  for (const auto& path : o.files) {
    auto f = std::make_unique<PreparedFile>(path);
    const PreparedHeader& h = f->header();
    STRATA_REQUIRE(o.vocab_size == 0 || std::int64_t(h.vocab_size) <= o.vocab_size,
                   "{}: prepared with a tokenizer of {} tokens, more than this model's "
                   "vocab_size {}: it is another model's data; prepare it with this model's "
                   "tokenizer (strata-prep --model DIR)",
                   path, h.vocab_size, o.vocab_size);
    STRATA_REQUIRE(o.tokenizer_hash.empty() || h.tokenizer_hash_hex() == o.tokenizer_hash,
                   "{}: prepared with another tokenizer (hash {}) than the model's {} (hash {}): "
                   "its ids would mean other text to this model; prepare it again with "
                   "strata-prep --model DIR (or --tokenizer DIR) naming this model's folder",
                   path, h.tokenizer_hash_hex(), o.tokenizer_origin, o.tokenizer_hash);
    const std::int64_t n = f->documents();
    const std::int64_t cut = n - static_cast<std::int64_t>(double(n) * o.val_fraction);
    const std::int64_t d0 = split == DataSplit::kTrain ? 0 : cut,
                       d1 = split == DataSplit::kTrain ? cut : n;
    pack(*f, std::uint32_t(pf.files.size()), d0, d1, o.seq_len, pf.rows, pf.extent.split_documents);
    pf.extent.tokens += f->doc_start(d1) - f->doc_start(d0);
    pf.extent.documents += d1 - d0;
    for (std::int64_t i = f->doc_start(d0); i < f->doc_start(d1); ++i)
      pf.extent.counted += f->counted(i);
    pf.files.push_back(std::move(f));
  }
  pf.extent.rows = std::int64_t(pf.rows.size());
  pf.extent.prepared = true;
  return pf;
}

// Row `r` written at [out, out + T) of the batch.
void fill_row(const PackedFiles& pf, const PackedRow& r, std::int64_t T, std::int64_t vocab,
              std::int32_t* tokens, std::int32_t* targets, std::int32_t* positions) {
  const PreparedFile& f = *pf.files[r.file];
  // The document holding r.begin: the last start <= r.begin.
  std::int64_t lo = 0, hi = f.documents() - 1;
  while (lo < hi) {
    const std::int64_t mid = (lo + hi + 1) / 2;
    if (f.doc_start(mid) <= r.begin)
      lo = mid;
    else
      hi = mid - 1;
  }
  std::int64_t d = lo, doc_end = f.doc_start(d + 1), start = r.begin;
  for (std::int64_t j = r.begin, i = 0; i < T; ++j, ++i) {
    if (j >= r.end) {  // padding: a block of its own, predicting nothing
      tokens[i] = 0;
      targets[i] = kIgnoreTarget;
      positions[i] = std::int32_t(j - r.end);
      continue;
    }
    if (j == doc_end) {
      ++d;
      start = j;
      doc_end = f.doc_start(d + 1);
    }
    // Each id read, the input's and the target's (the next row's first token is this row's last
    // target); 4-byte ids past 2^31 read as negative (one of 2^32 - 100 as the ignored target).
    const auto checked = [&](std::int64_t at) {
      const std::int32_t id = f.token(at);
      STRATA_REQUIRE(id >= 0 && (vocab == 0 || id < vocab),
                     "{}: token id {} (token {}) is outside the model's vocab_size {}: a damaged "
                     "file",
                     f.path(), std::uint32_t(id), at, vocab);
      return id;
    };
    tokens[i] = checked(j);
    positions[i] = std::int32_t(j - start);
    targets[i] = j + 1 < doc_end && f.counted(j + 1) ? checked(j + 1) : kIgnoreTarget;
  }
}

}  // namespace

DataExtent measure_tokens(const DataOptions& o, DataSplit split) {
  check_options(o);
  if (any_prepared(o)) return open_packed(o, split).extent;
  DataExtent e;
  for (const auto& path : o.files) {
    auto f = open_tokens(path, o.format, o.vocab_size);
    cut_split(*f, o.val_fraction, split);
    e.tokens += f->end - f->begin;
    e.rows += rows_of(*f, o);
  }
  return e;
}

struct TokenLoader::Impl {
  DataOptions opt;
  // Prepared files: their rows; `order` is this epoch's order of them.
  std::unique_ptr<PackedFiles> packed;
  std::vector<std::uint32_t> row_order;
  std::size_t next_row = 0;
  std::vector<std::unique_ptr<TokenFile>> files;
  // Unshuffled: current file and position (token index).
  std::size_t file = 0;
  std::int64_t pos = 0;
  // Shuffled: (file, window start) of every window in file order, and this epoch's permutation of
  // them.
  std::vector<std::pair<std::uint32_t, std::int64_t>> windows, order;
  std::size_t next_window = 0;
  std::int64_t epoch = 0;

  std::int64_t bt() const { return opt.batch * opt.seq_len; }

  void start_epoch() {
    if (packed) {
      row_order.resize(packed->rows.size());
      for (std::size_t i = 0; i < row_order.size(); ++i) row_order[i] = std::uint32_t(i);
      if (opt.shuffle) {
        std::mt19937_64 rng(opt.seed + 0x9e3779b97f4a7c15ull * std::uint64_t(epoch));
        for (std::size_t i = row_order.size(); i > 1; --i)
          std::swap(row_order[i - 1], row_order[rng() % i]);
      }
      next_row = 0;
      return;
    }
    if (!opt.shuffle) {
      file = 0;
      while (files[file]->end - files[file]->begin < bt() + 1) ++file;  // one exists (constructor)
      pos = files[file]->begin;
      return;
    }
    std::mt19937_64 rng(opt.seed + 0x9e3779b97f4a7c15ull * std::uint64_t(epoch));
    order = windows;
    for (std::size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[rng() % i]);
    next_window = 0;
  }

  void fetch(const TokenFile& f, std::int64_t at, std::int64_t count, std::int32_t* out) const {
    for (std::int64_t i = 0; i < count; ++i) {
      const std::int64_t v = f.id(at + i);
      STRATA_REQUIRE(opt.vocab_size == 0 || v < opt.vocab_size,
                     "{}: token id {} at byte offset {} is >= the model's vocab_size {}: {}",
                     f.path, v, f.data_offset + std::size_t(at + i) * f.elem, opt.vocab_size,
                     f.elem == 4 ? "if the file holds uint16 ids, give --data-dtype u16; if it is "
                                   "another model's, tokenize the text with this model's tokenizer"
                                 : "the ids are another model's (or not ids): tokenize the text "
                                   "with this model's tokenizer (strata-prep --model)");
      out[i] = static_cast<std::int32_t>(v);
    }
  }

  Batch next() {
    const std::int64_t B = opt.batch, T = opt.seq_len, n = bt();
    Batch b;
    b.tokens.resize(std::size_t(n));
    b.targets.resize(std::size_t(n));
    if (packed) {
      b.positions.resize(std::size_t(n));
      for (std::int64_t r = 0; r < B; ++r) {
        if (next_row == row_order.size()) {
          ++epoch;
          start_epoch();
        }
        fill_row(*packed, packed->rows[row_order[next_row++]], T, opt.vocab_size,
                 b.tokens.data() + r * T, b.targets.data() + r * T, b.positions.data() + r * T);
      }
      return b;
    }
    if (!opt.shuffle) {
      std::vector<std::int32_t> buf(std::size_t(n + 1));
      fetch(*files[file], pos, n + 1, buf.data());
      std::copy_n(buf.begin(), n, b.tokens.begin());
      std::copy_n(buf.begin() + 1, n, b.targets.begin());
      pos += n;
      if (pos + n + 1 > files[file]->end) {
        // Next file with at least one batch (the constructor checked that one exists).
        do {
          if (++file == files.size()) {
            file = 0;
            ++epoch;
          }
        } while (files[file]->end - files[file]->begin < n + 1);
        pos = files[file]->begin;
      }
      return b;
    }
    std::vector<std::int32_t> buf(std::size_t(T + 1));
    for (std::int64_t r = 0; r < B; ++r) {
      if (next_window == order.size()) {
        ++epoch;
        start_epoch();
      }
      const auto [fi, at] = order[next_window++];
      fetch(*files[fi], at, T + 1, buf.data());
      std::copy_n(buf.begin(), T, b.tokens.begin() + r * T);
      std::copy_n(buf.begin() + 1, T, b.targets.begin() + r * T);
    }
    return b;
  }
};

TokenLoader::TokenLoader(const DataOptions& o, DataSplit split) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.opt = o;
  check_options(o);
  if (any_prepared(o)) {
    m.packed = std::make_unique<PackedFiles>(open_packed(o, split));
    const DataExtent& e = m.packed->extent;
    STRATA_REQUIRE(
        e.rows >= 1, "the {} split of the prepared data holds no document{}",
        split == DataSplit::kTrain ? "train" : "validation",
        split == DataSplit::kVal && o.val_fraction > 0
            ? fmt::format(" (validation takes the last {:g}% of each file's documents, none of "
                          "a file of fewer than {:g}): give more documents (a text file is "
                          "one, or those --separator STR splits it into), or the validation "
                          "data apart (--eval-data FILE)",
                          100 * o.val_fraction, std::ceil(1 / o.val_fraction))
            : std::string(": give more data"));
    m.start_epoch();
    return;
  }
  bool any_batch = false;
  std::string sizes;  // "file: N tokens" of each, for the message when nothing fits
  std::vector<std::string> too_short;  // read in order, files that hold no batch
  for (const auto& path : o.files) {
    auto f = open_tokens(path, o.format, o.vocab_size);
    const std::int64_t ntok = f->end;
    if (sizes.size() < 400)
      sizes += fmt::format("{}{}: {} tokens", sizes.empty() ? "" : ", ", path, ntok);
    cut_split(*f, o.val_fraction, split);
    if (o.shuffle) {
      for (std::int64_t at = f->begin; at + o.seq_len + 1 <= f->end; at += o.seq_len)
        m.windows.emplace_back(static_cast<std::uint32_t>(m.files.size()), at);
    } else if (rows_of(*f, o) > 0) {
      any_batch = true;
    } else {
      too_short.push_back(fmt::format("{} ({} tokens)", path, f->end - f->begin));
    }
    m.files.push_back(std::move(f));
  }
  const char* which = split == DataSplit::kTrain ? "train" : "validation";
  const std::string split_is =
      o.val_fraction > 0 ? fmt::format(" (the {} split is {}% of each file{})", which,
                                       split == DataSplit::kTrain ? 100 - 100 * o.val_fraction
                                                                  : 100 * o.val_fraction,
                                       split == DataSplit::kTrain ? "" : ", with --eval-every")
                         : std::string();
  // Files read whole (no validation split, or --eval-data's) are said as the files, not as a
  // "train split" of them.
  const std::string part = o.val_fraction > 0 ? fmt::format("{} split", which) : "data";
  const std::string of_file = o.val_fraction > 0 ? fmt::format("'s {} split", which) : "";
  const std::string of_these = o.val_fraction > 0 ? fmt::format("the {} split of ", which) : "";
  if (o.shuffle)
    STRATA_REQUIRE(std::int64_t(m.windows.size()) >= 1,
                   "the {} has no window of --seq-len + 1 = {} tokens{}; the "
                   "data: {}. Give more "
                   "data or a shorter --seq-len",
                   part, o.seq_len + 1, split_is, sizes);
  else
    STRATA_REQUIRE(any_batch,
                   "no file{} holds --micro-batch x --seq-len + 1 = {} tokens{}; the data: {}. "
                   "Give more data or a smaller --micro-batch / --seq-len",
                   of_file, m.bt() + 1, split_is, sizes);
  if (!o.shuffle && !too_short.empty())
    log::warn(
        "{}{} holds fewer than --micro-batch x --seq-len + 1 = {} tokens{}: "
        "read in order, none of it is in a batch",
        of_these, fmt::join(too_short, ", "), m.bt() + 1, split_is);
  m.start_epoch();
}

TokenLoader::~TokenLoader() = default;
Batch TokenLoader::next() { return impl_->next(); }
void TokenLoader::reset() {
  impl_->epoch = 0;
  impl_->start_epoch();
}
std::int64_t TokenLoader::epoch() const { return impl_->epoch; }
std::int64_t TokenLoader::batches_per_epoch() const {
  const Impl& m = *impl_;
  if (m.packed) return std::int64_t(m.packed->rows.size()) / m.opt.batch;
  if (m.opt.shuffle) return std::int64_t(m.windows.size()) / m.opt.batch;
  std::int64_t n = 0;
  for (const auto& f : m.files) n += rows_of(*f, m.opt) / m.opt.batch;
  return n;
}
std::int64_t TokenLoader::num_tokens() const {
  if (impl_->packed) return impl_->packed->extent.tokens;
  std::int64_t n = 0;
  for (const auto& f : impl_->files) n += f->end - f->begin;
  return n;
}

}  // namespace strata
