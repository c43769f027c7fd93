// Shared pieces of strata-bench: each subcommand registers itself on the CLI, prints a
// table for people, and with --json prints, last, one JSON object of its figures
// (snake_case keys with units) so runs can be compared.
#pragma once

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <latch>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

namespace strata::bench {

// Subcommands (one file each).
void add_nvme_command(CLI::App& app);
void add_adam_command(CLI::App& app);
void add_comm_command(CLI::App& app);
void add_model_command(CLI::App& app);
void add_tp_command(CLI::App& app);
void add_engine_command(CLI::App& app);
void add_gpu_command(CLI::App& app);
void add_tokenize_command(CLI::App& app);

// Prints `figures` as one line of JSON on stdout (call it last, when --json is given).
void print_json(const nlohmann::json& figures);

// A ratio of a measured rate to a bound measured in the same run (a rate it cannot truly beat):
// above 1.02 the bound, not the measurement, is wrong, and the output says "broken bound" (the
// table's `broken_bound_note`, `broken_bound` in the JSON), never a success.
constexpr double kBrokenBoundRatio = 1.02;
inline bool broken_bound(double ratio) { return ratio > kBrokenBoundRatio; }
inline const char* broken_bound_note(double ratio) {
  return broken_bound(ratio) ? "  broken bound" : "";
}
// How a JSON `reference` names the threshold: "above 1.02 a broken bound".
inline std::string broken_bound_clause() {
  return fmt::format("above {} a broken bound", kBrokenBoundRatio);
}
// The config.json of a Llama of these sizes (model, tp: their --hidden, --layers, ... flags), its
// context `seq` positions.
nlohmann::json llama_config_json(std::int64_t vocab, std::int64_t hidden, std::int64_t inter,
                                 std::int64_t layers, std::int64_t heads, std::int64_t kv_heads,
                                 std::int64_t seq);
// The exit code a subcommand that ran to its end reports (1: a measured part failed; its
// figures, printed, stay the last JSON object): strata-bench returns it.
int& exit_code();

// A STREAM-like triad a[i] = b[i] + s * c[i] over three fp32 arrays of `bytes_per_array`
// bytes each with `threads` threads; best of `reps` runs, in GB/s counting 3 arrays moved.
double triad_gbps(std::size_t bytes_per_array, int threads, int reps = 5);
// A STREAM-like copy a[i] = b[i] (2 arrays moved), best of `reps`, GB/s.
double copy_gbps(std::size_t bytes_per_array, int threads, int reps = 5);

class Stopwatch {
 public:
  Stopwatch() : t0_(std::chrono::steady_clock::now()) {}
  double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  }
  void restart() { t0_ = std::chrono::steady_clock::now(); }

 private:
  std::chrono::steady_clock::time_point t0_;
};

// Runs body(lo, hi) on `threads` threads over [0, n), split evenly; returns wall seconds.
template <class Body>
double timed_parallel(std::size_t n, int threads, Body body) {
  threads = std::max(threads, 1);
  // Timed from the moment every thread is made and waiting until the last one is done: the
  // threads' creation is not the loop's time (a pool, as the optimizer's, makes them once; at
  // small sizes it was a large part of the "bound", which the step then beat).
  std::latch ready(threads), go(1);
  std::atomic<std::int64_t> last_end{0};
  const auto now_ns = [] {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  };
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    const std::size_t lo = n * std::size_t(t) / std::size_t(threads);
    const std::size_t hi = n * std::size_t(t + 1) / std::size_t(threads);
    pool.emplace_back([&, lo, hi] {
      ready.count_down();
      go.wait();
      body(lo, hi);
      const std::int64_t end = now_ns();
      for (std::int64_t seen = last_end.load();
           end > seen && !last_end.compare_exchange_weak(seen, end);) {
      }
    });
  }
  ready.wait();
  const std::int64_t start = now_ns();
  go.count_down();
  for (auto& th : pool) th.join();
  return double(last_end.load() - start) / 1e9;
}

// "1.5 GiB", "512 KiB".
std::string human_bytes(double bytes);
// Parses "4G", "512M", "1048576", "64k" (binary units); throws strata::Error naming `what`.
std::size_t parse_bytes(const std::string& text, const std::string& what);

}  // namespace strata::bench
