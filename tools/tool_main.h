// How strata's command-line tools end, the same way in each: --help exits 0; a bad command
// line prints one line (CLI11's reason, a flag a typo away from an unknown one, "see --help") and
// exits 1; a strata::Error prints one line (Error::user_message) and exits 1, and with --json on
// the command line also prints, last, {"error": ..., "kind": ...} on stdout, so a script reading
// the last JSON object finds out why there are no figures. One rank of several failing ends the
// whole MPI job (its peers would wait for it for ever).
#pragma once

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "strata/adamw.h"
#include "strata/comm.h"
#include "strata/error.h"
#include "strata/json_config.h"

namespace strata::tools {

// Number checks with a readable message (CLI11's own print their range up to DBL_MAX in full).
inline CLI::Validator sign_check(bool zero_ok) {
  return CLI::Validator(
      [zero_ok](std::string& text) -> std::string {
        double v = 0;
        try {
          std::size_t used = 0;
          v = std::stod(text, &used);
          if (used != text.size()) return "'" + text + "' is not a number";
        } catch (const std::exception&) {
          return "'" + text + "' is not a number";
        }
        if (!std::isfinite(v)) return "'" + text + "' is not a finite number";
        if (zero_ok ? v >= 0 : v > 0) return {};
        return std::string(zero_ok ? "must be >= 0" : "must be > 0") + ", got " + text;
      },
      zero_ok ? "NUMBER >= 0" : "NUMBER > 0");
}
inline const CLI::Validator kNonNegative = sign_check(true);
inline const CLI::Validator kPositive = sign_check(false);
// A count: a whole number >= 0 that fits in 64 bits (CLI11 would take 99999999999999999999 as
// the largest one, silently).
inline const CLI::Validator kCount(
    [](std::string& text) -> std::string {
      long long v = 0;
      const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
      if (ec == std::errc::result_out_of_range)
        return "'" + text + "' is beyond the largest count, 2^63 - 1";
      if (ec != std::errc() || end != text.data() + text.size())
        return "'" + text + "' is not a whole number";
      if (v < 0) return "must be >= 0, got " + text;
      return {};
    },
    "COUNT");

// A path under /dev (/dev/null, /dev/stdout, whatever the shell sent that to): the user's
// choice of where a stream goes, never a file of theirs to keep.
inline bool device_path(const std::string& path) { return path.starts_with("/dev/"); }

// A file of the user's at `path` (a regular file, or a link to none: a folder, a device or a pipe
// is no file to replace) is replaced only with --overwrite.
inline void require_overwrite_to_replace(const std::string& flag, const std::string& path,
                                         bool overwrite) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (path.empty() || overwrite || device_path(path) || !fs::exists(fs::symlink_status(path, ec)))
    return;
  const fs::file_status st = fs::status(path, ec);
  STRATA_REQUIRE(fs::exists(st) && !fs::is_regular_file(st),
                 "{} {} exists: pass --overwrite to replace it", flag, path);
}

// A file the tool reads is there and is a file (a folder named by mistake is said as one).
inline void require_input_file(const std::string& flag, const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const std::string named = flag.empty() ? path : flag + " " + path;
  STRATA_REQUIRE(!fs::is_directory(path, ec), "{} is a folder, not a file: give the file itself",
                 named);
  STRATA_REQUIRE(fs::exists(path, ec), "{}: no such file", named);
  STRATA_REQUIRE(fs::is_regular_file(path, ec), "{} is not a regular file (a device or a pipe)",
                 named);
}

// A folder the tool reads or writes in is there and is a folder (a file named by mistake is said
// as one).
inline void require_input_folder(const std::string& flag, const std::string& path,
                                 const std::string& what) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const std::string named = flag.empty() ? path : flag + " " + path;
  STRATA_REQUIRE(!fs::exists(path, ec) || fs::is_directory(path, ec),
                 "{} is a file, not a folder: give {}", named, what);
  STRATA_REQUIRE(fs::is_directory(path, ec), "{}: no such folder", named);
}

// A file a tool writes when it is done (a recommendation, a picture, a trace), checked before
// anything is measured, so a run of minutes does not end in "cannot be written": its folder
// exists and takes a new file, and a file already there (a user's ds_config.json, say) is
// replaced only with --overwrite. A device or a pipe (/dev/null, /dev/stdout) holds nothing to
// replace. An empty path is no file.
inline void require_output_file(const char* flag, const std::string& path, bool overwrite) {
  if (path.empty()) return;
  namespace fs = std::filesystem;
  std::error_code ec;
  STRATA_REQUIRE(!fs::is_directory(path, ec), "{} {} is a folder: give a file name", flag, path);
  if (fs::exists(fs::symlink_status(path, ec))) {
    require_overwrite_to_replace(flag, path, overwrite);
    if (::access(path.c_str(), W_OK) != 0)
      STRATA_THROW(kIo, "{} {}: cannot be replaced: {}", flag, path, std::strerror(errno));
    return;
  }
  const fs::path dir = fs::path(path).parent_path();
  const std::string where = dir.empty() ? std::string(".") : dir.string();
  // "DIR/.": a file where the folder should be is ENOTDIR, not a writable file.
  if (::access((where + "/.").c_str(), W_OK) != 0)
    STRATA_THROW(kIo, "{} {}: cannot be written in {}: {}", flag, path, where,
                 std::strerror(errno));
}

// Whether two paths name one file: the same path once links, "." and ".." are resolved, or one
// file under two names (hard links). An empty path names none.
inline bool same_file(const std::string& x, const std::string& y) {
  namespace fs = std::filesystem;
  if (x.empty() || y.empty()) return false;
  auto key = [](const std::string& p) {
    std::error_code ec;
    const fs::path k = fs::weakly_canonical(fs::absolute(p), ec);
    return ec ? fs::absolute(p).lexically_normal() : k;
  };
  std::error_code ec;
  return key(x) == key(y) || (fs::equivalent(x, y, ec) && !ec);
}

// Flags and the paths they name.
using NamedPaths = std::vector<std::pair<std::string, std::string>>;

// What a tool writes, against itself and what it reads, checked before anything is written: no
// file named twice (the later write would replace the earlier), and no file the tool reads (a
// corpus, a config, a model's weights), --overwrite or not. A device or a pipe (/dev/null,
// /dev/stdout) holds nothing to replace.
inline void require_outputs_apart(const char* tool, const NamedPaths& outs, const NamedPaths& ins) {
  namespace fs = std::filesystem;
  for (std::size_t i = 0; i < outs.size(); ++i) {
    std::error_code ec;
    const fs::file_status st = fs::status(outs[i].second, ec);
    if (device_path(outs[i].second) || (fs::exists(st) && !fs::is_regular_file(st))) continue;
    for (std::size_t k = i + 1; k < outs.size(); ++k)
      STRATA_REQUIRE(!same_file(outs[i].second, outs[k].second),
                     "{} and {} both name {}: give each its own file", outs[i].first, outs[k].first,
                     outs[i].second);
    for (const auto& [flag, path] : ins)
      STRATA_REQUIRE(!same_file(outs[i].second, path),
                     "{} {} is the {} file: {} would replace it; write it elsewhere", outs[i].first,
                     outs[i].second, flag, tool);
  }
}

// The files of a Hugging Face folder strata reads (config, weights, tokenizer, chat template,
// generation settings) that are in `folder`, each named "<flag> folder's <name>"; none where it is
// no folder. Other files there (a log kept beside the model) are the user's to name.
inline NamedPaths model_files_in_folder(const std::string& flag, const std::string& folder) {
  namespace fs = std::filesystem;
  static const char* const kRead[] = {"config.json",           "generation_config.json",
                                      "tokenizer.json",        "tokenizer.model",
                                      "tokenizer_config.json", "special_tokens_map.json",
                                      "chat_template.jinja",   "chat_template.json"};
  NamedPaths out;
  std::error_code ec;
  if (folder.empty() || !fs::is_directory(folder, ec)) return out;
  for (const auto& e : fs::directory_iterator(folder, ec)) {
    const std::string name = e.path().filename().string();
    const bool read = name.ends_with(".safetensors") || name.ends_with(".safetensors.index.json") ||
                      std::find(std::begin(kRead), std::end(kRead), name) != std::end(kRead);
    if (read && e.is_regular_file(ec))
      out.push_back({flag + " folder's " + name, e.path().string()});
  }
  return out;
}

// A JSON file the tool reads (a checkpoint's layout, a model folder's generation_config.json):
// one that cannot be read or parsed is a strata::Error naming it.
inline nlohmann::json read_json_file(const std::string& path) {
  std::ifstream f(path);
  STRATA_REQUIRE(bool(f), "{} cannot be read: {}", path, std::strerror(errno));
  std::stringstream ss;
  ss << f.rdbuf();
  try {
    return nlohmann::json::parse(ss.str());
  } catch (const std::exception& e) {
    STRATA_THROW(kInvalidArgument, "{} is not valid JSON: {}", path, e.what());
  }
}

// Set by a tool whose every rank starts MPI (strata-train, strata-prof): a rank that fails before
// MPI is up then joins its peers to end the job (end_job_if_one_of_many's join_if_not_up).
inline bool g_ranks_start_mpi = false;

// The error path: one line on stderr, the JSON object with --json, the job ended if this is one
// rank of several; returns the exit code.
inline int fail(const char* name, int argc, char** argv, const std::string& message,
                const char* kind) {
  std::fprintf(stderr, "%s: %s\n", name, message.c_str());
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--json") != 0) continue;
    std::fflush(stderr);
    std::printf("%s\n", nlohmann::json{{"error", message}, {"kind", kind}}.dump().c_str());
    break;
  }
  std::fflush(stdout);
  std::fflush(stderr);
  end_job_if_one_of_many(message,
                         g_ranks_start_mpi);  // the other ranks would wait for this one for ever
  return 1;
}

// Parses the command line into `app`, then returns body()'s exit code.
template <class Body>
int run_tool(const char* name, CLI::App& app, int argc, char** argv, Body&& body) {
  try {
    app.parse(argc, argv);
    cpu_isa_cap();  // a bad STRATA_CPU_ISA said first, not half-way through the tool's output
    return body();
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success))
      return app.exit(e);  // --help
    // One line, as every other error: what is wrong, a flag a typo away from an unknown one,
    // and where the rest is.
    std::string message = e.what();
    // A tool of subcommands given a first word that is none: name it and the ones there are
    // (CLI11 says only "A subcommand is required").
    if (dynamic_cast<const CLI::RequiredError*>(&e) != nullptr && argc > 1 && argv[1][0] != '-') {
      std::string names;
      bool known = false;
      for (const CLI::App* sub : app.get_subcommands({})) {
        names += (names.empty() ? "" : ", ") + sub->get_name();
        known = known || sub->get_name() == argv[1];
      }
      if (!names.empty() && !known)
        message = fmt::format("'{}' is not a subcommand: give one of {}", argv[1], names);
    }
    if (dynamic_cast<const CLI::ExtrasError*>(&e) != nullptr) {
      std::vector<std::string> flags;
      auto add = [&](const CLI::App* a) {
        for (const CLI::Option* opt : a->get_options())
          for (const std::string& l : opt->get_lnames()) flags.push_back("--" + l);
      };
      add(&app);
      for (const CLI::App* sub : app.get_subcommands()) add(sub);
      for (int i = 1; i < argc; ++i) {
        const std::string arg = std::string(argv[i]).substr(0, std::string(argv[i]).find('='));
        if (!arg.starts_with("--") || std::find(flags.begin(), flags.end(), arg) != flags.end())
          continue;
        const std::string guess = config::near_miss(arg, flags);
        if (!guess.empty()) message += fmt::format(" (did you mean {}?)", guess);
      }
    }
    std::fprintf(stderr, "%s: %s; see --help\n", name, message.c_str());
    for (int i = 1; i < argc; ++i) {
      if (std::strcmp(argv[i], "--json") != 0) continue;
      std::printf("%s\n",
                  nlohmann::json{{"error", message}, {"kind", "invalid argument"}}.dump().c_str());
      break;
    }
    std::fflush(stdout);
    std::fflush(stderr);
    end_job_if_one_of_many(message, g_ranks_start_mpi);
    return 1;
  } catch (const Error& e) {
    return fail(name, argc, argv, e.user_message(), error_kind_name(e.kind()));
  } catch (const std::exception& e) {  // not strata's (a library's, bad_alloc): the same way out
    return fail(name, argc, argv, e.what(), "error");
  }
}

}  // namespace strata::tools
