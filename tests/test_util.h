// Small helpers shared by the test suites.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "strata/comm.h"
#include "strata/device.h"
#include "strata/error.h"

namespace strata::testing {

// A fresh directory (under `parent`, by default the system's temp directory), removed with
// everything in it when the object goes away.
struct TempDir {
  explicit TempDir(const std::string& prefix = "strata-test",
                   const std::string& parent = std::filesystem::temp_directory_path().string()) {
    std::string tmpl = (std::filesystem::path(parent) / (prefix + "-XXXXXX")).string();
    STRATA_CHECK(::mkdtemp(tmpl.data()) != nullptr, "cannot create a temporary directory {}", tmpl);
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string path;
};

// A tmpfs of `mib` MiB mounted at `path` (made) while the object lives, for tests of a drive too
// small; `ok` false, with `why`, where it cannot be mounted (not root, no mount): those skip.
struct SmallTmpfs {
  SmallTmpfs(const std::string& where, int mib) : SmallTmpfs(where, std::to_string(mib) + "m") {}
  // `size` as mount takes it: "8k", "64m".
  SmallTmpfs(const std::string& where, const std::string& size) : path(where) {
    if (::geteuid() != 0) {
      why = "needs root to mount a small tmpfs";
      return;
    }
    std::filesystem::create_directories(path);
    const std::string cmd = "mount -t tmpfs -o size=" + size + " tmpfs '" + path + "' 2>/dev/null";
    ok = std::system(cmd.c_str()) == 0;
    if (!ok) why = "cannot mount a tmpfs here";
  }
  ~SmallTmpfs() {
    if (ok)
      (void)std::system(("umount '" + path + "' 2>/dev/null || umount -l '" + path + "'").c_str());
  }
  SmallTmpfs(const SmallTmpfs&) = delete;
  SmallTmpfs& operator=(const SmallTmpfs&) = delete;
  std::string path, why;
  bool ok = false;
};

// The whole content of a file ("" when it cannot be read).
inline std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

struct Result {
  int status = -1;  // the exit code, or -1 when it did not exit normally
  std::string out, err;
};

// Starts `bin args...` (its stdout/stderr captured in `dir` under `tag`: <tag>.stdout,
// <tag>.stderr) and returns its pid without waiting: for a test that signals it.
inline pid_t start(const std::string& bin, const std::vector<std::string>& args,
                   const std::string& dir, const std::string& tag,
                   const std::vector<std::pair<std::string, std::string>>& env = {}) {
  const std::string out = dir + "/" + tag + ".stdout", err = dir + "/" + tag + ".stderr";
  const pid_t pid = ::fork();
  if (pid == 0) {
    for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
    // The signals a test sends arrive as in a shell's foreground job, whatever ctest inherited
    // (a script's background job starts with SIGINT ignored).
    ::signal(SIGINT, SIG_DFL);
    ::signal(SIGTERM, SIG_DFL);
    ::signal(SIGHUP, SIG_DFL);  // ignored under nohup
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    const int o = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int e = ::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(o, 1);
    ::dup2(e, 2);
    std::vector<std::string> copy = args;
    std::string b = bin;
    std::vector<char*> argv{b.data()};
    for (auto& a : copy) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(b.c_str(), argv.data());
    ::_exit(127);
  }
  return pid;
}

// Runs `bin args...` to completion in `dir` (its stdout/stderr captured there under `tag`).
inline Result run(const std::string& bin, const std::vector<std::string>& args,
                  const std::string& dir, const std::string& tag,
                  const std::vector<std::pair<std::string, std::string>>& env = {}) {
  const pid_t pid = start(bin, args, dir, tag, env);
  int st = 0;
  ::waitpid(pid, &st, 0);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, slurp(dir + "/" + tag + ".stdout"),
          slurp(dir + "/" + tag + ".stderr")};
}

// The message of what `fn` throws (empty when it does not throw strata::Error).
template <class F>
std::string error_of(F&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return {};
}

// Expects `fn` to throw strata::Error whose message holds every one of `needles`.
inline void expect_error(const std::function<void()>& fn,
                         std::initializer_list<std::string> needles) {
  try {
    fn();
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    for (const auto& n : needles)
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
  }
}

// This machine's host name (what strata's messages call "this node").
inline std::string host_name() {
  char h[256] = {};
  return ::gethostname(h, sizeof h - 1) == 0 ? std::string(h) : std::string("?");
}

// The path of `name` on PATH ("" when it is not there).
inline std::string find_on_path(const std::string& name) {
  const char* path = std::getenv("PATH");
  const std::string p = path ? path : "/usr/bin:/bin";
  for (std::size_t b = 0; b <= p.size();) {
    std::size_t e = p.find(':', b);
    if (e == std::string::npos) e = p.size();
    const std::filesystem::path cand = std::filesystem::path(p.substr(b, e - b)) / name;
    if (!cand.parent_path().empty() && ::access(cand.c_str(), X_OK) == 0) return cand.string();
    b = e + 1;
  }
  return {};
}

// Where scripts/npm-tokenizers.sh installs the reference packages: $STRATA_NPM_DIR, else
// /tmp/strata-npm.
inline std::string npm_dir() {
  const char* d = std::getenv("STRATA_NPM_DIR");
  return d && *d ? d : "/tmp/strata-npm";
}

// A byte-level BPE tokenizer.json of 20 ids (GPT-2's pre-tokenizer, a few merges, a BOS template;
// ids 18 and 19 are the two bytes of "é", so a sample may split a character over two tokens).
inline const char* kTinyTokenizer = R"({
  "version": "1.0",
  "added_tokens": [
    {"id": 16, "content": "<|end|>", "single_word": false, "lstrip": false, "rstrip": false,
     "normalized": false, "special": true},
    {"id": 17, "content": "<|bos|>", "single_word": false, "lstrip": false, "rstrip": false,
     "normalized": false, "special": true}],
  "normalizer": null,
  "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                    "use_regex": true},
  "post_processor": {"type": "TemplateProcessing",
    "single": [{"SpecialToken": {"id": "<|bos|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
    "pair": [],
    "special_tokens": {"<|bos|>": {"id": "<|bos|>", "ids": [17], "tokens": ["<|bos|>"]}}},
  "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
  "model": {"type": "BPE", "dropout": null, "unk_token": null, "byte_fallback": false,
    "vocab": {"h": 0, "e": 1, "l": 2, "o": 3, "\u0120": 4, "w": 5, "r": 6, "d": 7, "he": 8,
              "ll": 9, "llo": 10, "hello": 11, "\u0120w": 12, "or": 13, "\u0120wor": 14, "!": 15,
              "\u00c3": 18, "\u00a9": 19},
    "merges": ["h e", "l l", "ll o", "he llo", "\u0120 w", "o r", "\u0120w or"]}})";

// One process of a suite every rank of an mpirun runs: its launch, a CPU-emulated device and the
// job's communicator.
struct RankEnv {
  LaunchInfo launch;
  std::unique_ptr<Device> dev;
  std::unique_ptr<Communicator> comm;
};
// Fills `env` (a device of `capacity` bytes whose streams run each op up to `delay_us` late, to
// expose missing ordering); false, after saying why as `name`, when the launch cannot be made.
inline bool open_rank_env(RankEnv& env, std::size_t capacity, int delay_us, const char* name) {
  try {
    env.launch = init_launch();
    HostDeviceOptions o;
    o.capacity_bytes = capacity;
    o.random_delay_us = delay_us;
    env.dev = make_host_device(o);
    env.comm = make_communicator(*env.dev);
  } catch (const Error& e) {
    std::fprintf(stderr, "%s: %s\n", name, e.what());
    return false;
  }
  return true;
}
// RUN_ALL_TESTS() on one rank of such a suite: only rank 0 prints the results (every rank runs
// every test; any rank's failure fails the job), and a failing rank says so as `name`.
inline int run_tests_on_rank(int rank, const char* name) {
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  const int rc = RUN_ALL_TESTS();
  if (rc != 0) std::fprintf(stderr, "%s: rank %d failed\n", name, rank);
  return rc;
}

}  // namespace strata::testing
