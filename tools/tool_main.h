// How strata's command-line tools end, the same way in each: --help exits 0; a bad command
// line prints one line (CLI11's reason, a flag a typo away from an unknown one, "see --help") and
// exits 1; a strata::Error prints one line (Error::user_message) and exits 1, and with --json on
// the command line also prints, last, {"error": ..., "kind": ...} on stdout, so a script reading
// the last JSON object finds out why there are no figures. One rank of several failing ends the
// whole MPI job (its peers would wait for it for ever).
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include "strata/adamw.h"
#include "strata/build_info.h"
#include "strata/comm.h"
#include "strata/error.h"
#include "strata/json_config.h"
#include "strata/paths.h"
#include "strata/system_info.h"

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

// A seed: a whole number in [0, 2^64 - 1] (CLI11 would wrap -1 to 2^64 - 1 and take
// 99999999999999999999 as the largest, silently).
inline const CLI::Validator kSeed(
    [](std::string& text) -> std::string {
      std::uint64_t v = 0;
      const char* first = text.data() + (text.starts_with('+') ? 1 : 0);
      const auto [end, ec] = std::from_chars(first, text.data() + text.size(), v);
      if (text.starts_with('-')) return "must be >= 0, got " + text;
      if (ec == std::errc::result_out_of_range)
        return "'" + text + "' is beyond the largest seed, 2^64 - 1";
      if (ec != std::errc() || end != text.data() + text.size())
        return "'" + text + "' is not a whole number";
      return {};
    },
    "SEED");

// --max-shard-mb's MiB as bytes, at most 9e18 (1e300 MiB wrapped around to 0 bytes).
inline std::size_t mib_as_bytes(double mib) {
  return static_cast<std::size_t>(std::min(mib * 1024 * 1024, 9e18));
}

// A JSON file the tool reads (a checkpoint's layout, a model folder's generation_config.json):
// one that cannot be read or parsed is a strata::Error naming it.
inline nlohmann::json read_json_file(const std::string& path) {
  std::ifstream f(path);
  STRATA_REQUIRE(bool(f), "{} cannot be read: {}", path, std::strerror(errno));
  std::stringstream ss;
  ss << f.rdbuf();
  return strata::config::parse(ss.str(), path, /*duplicates_last_wins=*/true);
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

// What the process was started with, made safe to run in: a descriptor 0-2 its starter closed is
// /dev/null (the first file the tool opened took it: a --log-json file got the console's lines),
// and a write past `ulimit -f` fails with EFBIG, which the writer names with its file (SIGXFSZ
// ended the run without a word).
inline void settle_process() {
  for (int fd = 0; fd < 3; ++fd) {
    if (::fcntl(fd, F_GETFD) >= 0 || errno != EBADF) continue;
    const int n = ::open("/dev/null", O_RDWR | O_CLOEXEC);
    if (n < 0) continue;
    if (n != fd) {
      ::dup2(n, fd);  // (dup2's copy does not keep O_CLOEXEC)
      ::close(n);
    } else {
      ::fcntl(fd, F_SETFD, 0);
    }
  }
  ::signal(SIGXFSZ, SIG_IGN);
}

// What a tool runs beside reading and writing files.
enum class ToolRuns {
  // strata-info, -plot, -prep, -export: what they run beside files (strata-info --self-check's
  // kernels, strata-prep's tokenizing threads) starts after a reservation or a thread pool that
  // fails cleanly under a small address-space limit, so they are held to no floor
  files,
  // strata-train, -prof, -generate, -bench: oneDNN generates its code as the tool runs, and
  // crashed (SIGSEGV) under a small address-space limit
  kernels,
};

// Parses the command line into `app` (with --version), then returns body()'s exit code.
template <class Body>
int run_tool(const char* name, CLI::App& app, int argc, char** argv, ToolRuns runs, Body&& body) {
  settle_process();
  // (a function: asking whether CUDA is built in loads its libraries, which only --version needs)
  const std::function<std::string()> version = [name] {
    return fmt::format("{} {} (CUDA backend {})", name, strata_version(),
                       built_with_cuda() ? "on" : "off");
  };
  app.set_version_flag("--version", version);
  // and after a subcommand (`strata-bench adam --version`), which refused it as unexpected
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; }))
    sub->set_version_flag("--version", version);
  // A thread that could not start: under an address-space limit its stack is what failed.
  const auto no_thread = [](const std::string& what) {
    const std::uint64_t limit = address_space_limit();
    return limit != 0 ? fmt::format(
                            "cannot start a thread ({}): no room for its stack under the "
                            "process's address-space limit (`ulimit -v`), {} MiB, or the "
                            "thread limit is reached: raise `ulimit -v` (`ulimit -v "
                            "unlimited`), or `ulimit -u` / a container's pids limit",
                            what, limit >> 20)
                      : fmt::format(
                            "cannot start a thread ({}): the process's thread limit is "
                            "reached: raise `ulimit -u`, or a container's pids limit",
                            what);
  };
  try {
    // Once the command line is read, before anything runs (strata-bench's subcommands run in
    // their callbacks, inside parse(), after this one).
    app.parse_complete_callback([runs] {
      cpu_isa_cap();  // a bad STRATA_CPU_ISA said first, not half-way through the tool's output
      // Below it oneDNN's code generation crashed (SIGSEGV) rather than failing.
      if (const std::uint64_t limit = address_space_limit();
          runs == ToolRuns::kernels && limit != 0 && limit < kMinAddressSpace)
        STRATA_THROW(kInvalidArgument,
                     "the process's address-space limit (`ulimit -v`) is {} MiB, and strata "
                     "needs at least {} MiB of address space: raise it (`ulimit -v unlimited`)",
                     limit >> 20, kMinAddressSpace >> 20);
    });
    app.parse(argc, argv);
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
  } catch (const std::system_error& e) {
    // A thread the process could not start (std::thread's EAGAIN): said with the limit to raise.
    if (e.code() == std::errc::resource_unavailable_try_again)
      return fail(name, argc, argv, no_thread(e.what()), "error");
    return fail(name, argc, argv, e.what(), "error");
  } catch (const std::exception& e) {  // not strata's (a library's, bad_alloc): the same way out
    // oneTBB's workers: "pthread_create has failed: Resource temporarily unavailable".
    const std::string what = e.what();
    if (what.find("pthread_create") != std::string::npos &&
        what.find(std::strerror(EAGAIN)) != std::string::npos)
      return fail(name, argc, argv, no_thread(what), "error");
    return fail(name, argc, argv, what, "error");
  }
}

}  // namespace strata::tools
