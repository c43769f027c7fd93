// strata-prep: a corpus (text files, JSON lines, chat JSON lines) to the prepared training file
// strata-train --data reads: tokenized with the model folder's tokenizer on every core, with a
// progress bar on a terminal and a summary (--json: one object, last). docs/strata-prep.md.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "strata/corpus.h"
#include "strata/error.h"
#include "strata/log.h"
#include "strata/model_data.h"
#include "strata/nvme.h"
#include "strata/tokenizer.h"
#include "tool_main.h"

namespace {

struct Options {
  std::string model_dir, tokenizer_dir, out, text_field = "text", separator, chat_format;
  std::vector<std::string> inputs;
  int threads = 0;
  std::int64_t seq_len = 0;
  std::uint64_t max_document_tokens = 0;
  bool json = false, overwrite = false, text_field_named = false;
};

std::string human_bytes(double b) {
  const char* unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) {
    b /= 1024;
    ++u;
  }
  return fmt::format("{:.1f} {}", b, unit[u]);
}

int run(Options& o, bool separator_given) {
  namespace fs = std::filesystem;
  STRATA_REQUIRE(o.model_dir.empty() != o.tokenizer_dir.empty(),
                 "give the tokenizer's folder once: --model DIR (a Hugging Face model folder) or "
                 "--tokenizer DIR (a folder with tokenizer.json or tokenizer.model)");
  const std::string dir = o.model_dir.empty() ? o.tokenizer_dir : o.model_dir;
  const char* flag = o.model_dir.empty() ? "--tokenizer" : "--model";
  STRATA_REQUIRE(!strata::Tokenizer::file_in(dir).empty(),
                 "{} {}: no tokenizer.json (or tokenizer.model) there; give the folder of the "
                 "model's tokenizer (a Hugging Face model folder holds tokenizer.json and "
                 "tokenizer_config.json)",
                 flag, dir);
  strata::NamedPaths ins = strata::model_files_in_folder(flag, dir);
  for (const auto& in : o.inputs) {
    strata::require_input_file("", in);
    ins.push_back({"input", in});
  }
  strata::require_outputs_apart("strata-prep", {{"-o", o.out}}, ins);
  strata::require_output_file("-o", o.out, o.overwrite);
  const strata::Tokenizer tok = strata::Tokenizer::from_folder(dir);
  const std::string hash = strata::tokenizer_hash(dir, tok);

  strata::CorpusOptions c;
  c.text_field = o.text_field;
  c.text_field_named = o.text_field_named;
  if (separator_given) c.separator = o.separator;
  // The reader splits every input that is not JSON lines (a .txt, a .md, ...).
  if (separator_given && std::all_of(o.inputs.begin(), o.inputs.end(), strata::is_json_lines_file))
    strata::log::warn(
        "--separator is not used: it splits text inputs into documents, and every input here "
        "is JSON lines");
  if (o.text_field_named &&
      std::none_of(o.inputs.begin(), o.inputs.end(), strata::is_json_lines_file))
    strata::log::warn(
        "--text-field is not used: it names the text field of JSON lines records, and no input "
        "here is JSON lines");
  c.threads = o.threads;
  c.max_document_tokens = o.max_document_tokens;
  strata::use_chat_template(c, dir, o.chat_format);
  const bool tty = !o.json && ::isatty(::fileno(stderr));
  const auto t0 = std::chrono::steady_clock::now();
  if (tty)
    c.progress = [&](const strata::PrepProgress& p) {
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const double frac = p.bytes_total ? double(p.bytes_done) / double(p.bytes_total) : 1.0;
      const int width = 30, fill = int(frac * width + 0.5);
      std::fprintf(stderr,
                   "\r\x1b[Kstrata-prep [%s%s] %3.0f%%  %llu documents, %llu tokens, %.0f tokens/s",
                   std::string(std::size_t(fill), '#').c_str(),
                   std::string(std::size_t(width - fill), '.').c_str(), 100 * frac,
                   (unsigned long long)p.documents, (unsigned long long)p.tokens,
                   s > 0 ? double(p.tokens) / s : 0.0);
      std::fflush(stderr);
    };
  const strata::PrepSummary s = strata::prepare_corpus(tok, hash, o.inputs, o.out, c);
  if (tty) std::fprintf(stderr, "\r\x1b[K");

  // Rows at --seq-len: what the loader packs (strata/model_data.h), measured on the file.
  std::optional<strata::DataExtent> e;
  if (o.seq_len > 0) {
    strata::DataOptions d;
    d.files = {o.out};
    d.seq_len = o.seq_len;
    e = strata::measure_tokens(d);
  }
  const double masked = s.tokens ? 1.0 - double(s.counted_tokens) / double(s.tokens) : 0.0;
  const double tps = s.seconds > 0 ? double(s.tokens) / s.seconds : 0.0;
  std::FILE* out = o.json ? stderr : stdout;
  std::fprintf(out,
               "strata-prep: %s: %llu documents, %llu tokens (%.1f%% masked: targets not counted), "
               "%llu truncated; %s of input in %.2f s on %d thread%s, %.0f tokens/s\n",
               o.out.c_str(), (unsigned long long)s.documents, (unsigned long long)s.tokens,
               100 * masked, (unsigned long long)s.truncated_documents,
               human_bytes(double(s.input_bytes)).c_str(), s.seconds, s.threads,
               s.threads == 1 ? "" : "s", tps);
  if (e)
    std::fprintf(out,
                 "strata-prep: at --seq-len %lld: %lld rows (%.1f%% padding), %lld document%s "
                 "longer than a row split into row-sized pieces\n",
                 (long long)o.seq_len, (long long)e->rows,
                 e->rows ? 100.0 * (1.0 - double(e->tokens) / double(e->rows * o.seq_len)) : 0.0,
                 (long long)e->split_documents, e->split_documents == 1 ? "" : "s");
  std::fprintf(out, "strata-prep: tokenizer %s (hash %s, vocabulary %d)\n", dir.c_str(),
               hash.c_str(), tok.vocab_size());
  if (o.json) {
    nlohmann::json j = {
        {"out", o.out},
        {"documents", s.documents},
        {"tokens", s.tokens},
        {"counted_tokens", s.counted_tokens},
        {"masked_share", masked},
        {"truncated_documents", s.truncated_documents},
        {"input_bytes", s.input_bytes},
        {"seconds", s.seconds},
        {"tokens_per_s", tps},
        {"input_mb_per_s", s.seconds > 0 ? double(s.input_bytes) / 1e6 / s.seconds : 0.0},
        {"threads", s.threads},
        {"vocab_size", tok.vocab_size()},
        {"tokenizer_hash", hash}};
    if (e) {
      j["seq_len"] = o.seq_len;
      j["rows"] = e->rows;
      j["split_documents"] = e->split_documents;
    }
    std::printf("%s\n", j.dump().c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{
      "strata-prep: tokenize a corpus (text files, .jsonl records with a text field, chat .jsonl) "
      "with the model's tokenizer into the prepared file strata-train --data reads"};
  app.add_option("inputs", o.inputs,
                 "corpus files: JSON lines, .jsonl / .json (one JSON record a line), or text")
      ->required();
  app.add_option("--model", o.model_dir,
                 "the Hugging Face model folder (its tokenizer.json or tokenizer.model, and the "
                 "chat template in tokenizer_config.json for chat records)");
  app.add_option("--tokenizer", o.tokenizer_dir,
                 "a folder with tokenizer.json or tokenizer.model (instead of --model)");
  app.add_option("--chat-format", o.chat_format,
                 "chat records: render them in this layout (chatml, llama3, llama2, mistral, "
                 "none) instead of the folder's chat template");
  app.add_option("-o,--out", o.out, "the prepared file to write")->required();
  app.add_option("--text-field", o.text_field,
                 "JSON lines: the field holding the text (default text); given, it wins over a "
                 "record's chat keys");
  auto* sep = app.add_option("--separator", o.separator,
                             "text files: split into documents on this string (default: a file "
                             "is one document)");
  app.add_option("--threads", o.threads, "tokenizing threads (default: all cores)")
      ->check(CLI::Range(1, 4096));
  app.add_option("--seq-len", o.seq_len, "also report the rows the file packs into at this length")
      ->check(strata::tools::kPositive);
  app.add_option("--max-document-tokens", o.max_document_tokens,
                 "cut documents longer than this many tokens (reported as truncated; default: "
                 "none, the loader splits long documents across rows)")
      ->check(strata::tools::kCount);
  app.add_flag("--overwrite", o.overwrite, "replace the output file when it exists");
  app.add_flag("--json", o.json,
               "print, last, one JSON object with the summary (the text to stderr)");
  // Ctrl-C (a scheduler's SIGTERM, a closed terminal) removes the temporary file, which grows to
  // the prepared file's size, and says so.
  strata::remove_swap_files_on_interrupt();
  return strata::tools::run_tool(
      "strata-prep", app, argc, argv, strata::tools::ToolRuns::files, [&] {
        o.text_field_named = app.count("--text-field") > 0;
        strata::set_interrupt_note(
            fmt::format("\nstrata-prep: interrupted; {} was not written (its temporary file is "
                        "removed){}\n",
                        o.out, o.overwrite ? ", and what was there is as it was" : ""));
        return run(o, sep->count() > 0);
      });
}
