#include "bench_common.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <thread>
#include <vector>

#include "strata/error.h"
#include "strata/log.h"

namespace strata::bench {

int& exit_code() {
  static int code = 0;
  return code;
}

nlohmann::json llama_config_json(std::int64_t vocab, std::int64_t hidden, std::int64_t inter,
                                 std::int64_t layers, std::int64_t heads, std::int64_t kv_heads,
                                 std::int64_t seq) {
  return {{"model_type", "llama"},           {"vocab_size", vocab},
          {"hidden_size", hidden},           {"intermediate_size", inter},
          {"num_hidden_layers", layers},     {"num_attention_heads", heads},
          {"num_key_value_heads", kv_heads}, {"max_position_embeddings", seq}};
}

void print_json(const nlohmann::json& figures) {
  std::fflush(stdout);
  std::printf("%s\n", figures.dump().c_str());
  std::fflush(stdout);
}

double triad_gbps(std::size_t bytes_per_array, int threads, int reps) {
  const std::size_t n = bytes_per_array / sizeof(float);
  std::vector<float> a(n), b(n, 1.0f), c(n, 2.0f);
  // First touch from the worker threads, as the timed loop will touch it.
  timed_parallel(n, threads, [&](std::size_t lo, std::size_t hi) {
    std::fill(a.begin() + lo, a.begin() + hi, 0.0f);
  });
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const float s = 0.5f + r;
    best = std::min(best, timed_parallel(n, threads, [&](std::size_t lo, std::size_t hi) {
                      float* __restrict pa = a.data();
                      const float* __restrict pb = b.data();
                      const float* __restrict pc = c.data();
                      for (std::size_t i = lo; i < hi; ++i) pa[i] = pb[i] + s * pc[i];
                    }));
  }
  if (a[n / 2] == -1.0f) std::puts("");  // keeps the loop alive
  return 3.0 * n * sizeof(float) / best / 1e9;
}

double copy_gbps(std::size_t bytes_per_array, int threads, int reps) {
  const std::size_t n = bytes_per_array / sizeof(float);
  std::vector<float> a(n), b(n, 1.0f);
  timed_parallel(n, threads, [&](std::size_t lo, std::size_t hi) {
    std::fill(a.begin() + lo, a.begin() + hi, 0.0f);
  });
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    best = std::min(best, timed_parallel(n, threads, [&](std::size_t lo, std::size_t hi) {
                      std::copy(b.begin() + lo, b.begin() + hi, a.begin() + lo);
                    }));
  }
  return 2.0 * n * sizeof(float) / best / 1e9;
}

std::string human_bytes(double b) { return log::human_bytes(b, -2); }

std::size_t parse_bytes(const std::string& text, const std::string& what) {
  std::size_t pos = 0;
  double v = 0;
  try {
    v = std::stod(text, &pos);
  } catch (...) {
    pos = 0;
  }
  std::string suffix = text.substr(pos);
  for (char& c : suffix) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (!suffix.empty() && suffix.back() == 'b') suffix.pop_back();
  if (!suffix.empty() && suffix.back() == 'i') suffix.pop_back();
  double mult = 0;
  if (suffix.empty())
    mult = 1;
  else if (suffix == "k")
    mult = 1024.0;
  else if (suffix == "m")
    mult = 1024.0 * 1024;
  else if (suffix == "g")
    mult = 1024.0 * 1024 * 1024;
  else if (suffix == "t")
    mult = 1024.0 * 1024 * 1024 * 1024;
  STRATA_REQUIRE(pos > 0 && mult > 0 && v > 0,
                 "{} '{}' is not a size: write e.g. 4G, 512M, 64K or 1048576", what, text);
  // Past 2^62 bytes (a double past 2^64 converts to anything): no drive or memory has it.
  STRATA_REQUIRE(v * mult < 0x1p62,
                 "{} '{}' is more bytes than any drive or memory holds: write e.g. 4G or 512M",
                 what, text);
  return static_cast<std::size_t>(v * mult);
}

}  // namespace strata::bench
