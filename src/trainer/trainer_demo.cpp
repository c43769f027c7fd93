// The embedded demo strata-train runs when no model and no data are given: a small byte-level
// Llama trained on text from a tiny generated grammar, with weights and optimizer state on NVMe
// and an emulated device capped below the size of the fp32 weights, so every tier is exercised
// in a minute. Here: its model, its text, its engine config and where its files go.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "scheduler/layout.h"
#include "strata/error.h"
#include "trainer/train_job.h"

namespace strata {

namespace fs = std::filesystem;

// The demo model: a byte-level Llama (GQA, untied head). ~5.9M parameters, 24 MB in fp32.
ModelConfig demo_model_config() {
  const nlohmann::json j = {{"model_type", "llama"},
                            {"architectures", {"LlamaForCausalLM"}},
                            {"vocab_size", 256},
                            {"hidden_size", 256},
                            {"intermediate_size", 688},
                            {"num_hidden_layers", 8},
                            {"num_attention_heads", 8},
                            {"num_key_value_heads", 4},
                            {"max_position_embeddings", 512},
                            {"rms_norm_eps", 1e-5},
                            {"rope_theta", 10000.0},
                            {"tie_word_embeddings", false},
                            {"hidden_act", "silu"}};
  return parse_model_config(j.dump(), "the demo model");
}

std::string default_scratch_dir(const std::string& name) {
  std::error_code ec;
  const std::string exe = fs::read_symlink("/proc/self/exe", ec).string();
  const std::string build = STRATA_BUILD_DIR;
  if (!ec && exe.starts_with(build + "/")) return build + "/" + name;
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg)
    return std::string(xdg) + "/strata/" + name;
  if (const char* home = std::getenv("HOME"); home && *home)
    return std::string(home) + "/.cache/strata/" + name;
  // One name a user: another user's folder there is not this one's to write.
  return fmt::format("/var/tmp/strata-{}-{}", ::getuid(), name);
}

namespace train_job {

namespace {

// Sentences from a small grammar: the structure (spelling, word order, agreement of "a"/"an")
// is learnable within tens of steps, and the remaining entropy (which word comes next) keeps
// the loss from collapsing to zero.
std::string demo_text(std::size_t bytes, std::uint64_t seed) {
  static const char* subj[] = {"the cat",  "a dog",   "the old man", "my friend",
                               "the bird", "a child", "the teacher"};
  static const char* verb[] = {"sees", "likes", "finds", "chases", "helps", "paints", "follows"};
  static const char* adj[] = {"red", "small", "happy", "quiet", "green", "tall"};
  static const char* noun[] = {"ball", "tree", "house", "river", "car", "apple", "garden"};
  std::mt19937_64 rng(seed);
  auto pick = [&](auto& arr) { return arr[rng() % (sizeof(arr) / sizeof(arr[0]))]; };
  std::string s;
  while (s.size() < bytes) {
    s += pick(subj);
    s += ' ';
    s += pick(verb);
    s += rng() % 2 ? " the " : " a ";
    s += pick(adj);
    s += ' ';
    s += pick(noun);
    s += rng() % 3 ? ".\n" : ", and ";
  }
  return s;
}

}  // namespace

// The demo's text file, written only when it does not hold the text already, and then as a new
// file renamed over the old: another demo run may be reading the old one through mmap, and
// truncating a mapped file kills its reader (SIGBUS).
int demo_text_largest_byte() {
  static const int largest = [] {
    const std::string t = demo_text(std::size_t(1) << 20, 7);
    return int(static_cast<unsigned char>(*std::max_element(t.begin(), t.end())));
  }();
  return largest;
}

void write_demo_text(const std::string& path) {
  const std::string t = demo_text(std::size_t(1) << 20, 7);
  std::error_code ec;
  fs::create_directories(fs::path(path).parent_path(), ec);
  STRATA_REQUIRE(!ec, "the demo text's folder {} cannot be created: {}",
                 fs::path(path).parent_path().string(), ec.message());
  if (fs::file_size(path, ec) == t.size() && !ec) {
    std::ifstream in(path, std::ios::binary);
    std::string have(t.size(), '\0');
    if (in.read(have.data(), std::streamsize(have.size())) && have == t) return;
  }
  const std::string tmp = fmt::format("{}.tmp-{}", path, ::getpid());
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f.write(t.data(), std::streamsize(t.size()));
    f.close();
    if (!f) {
      const int err = errno;
      fs::remove(tmp, ec);
      STRATA_THROW(kIo, "cannot write the demo text to {}: {}", tmp, std::strerror(err));
    }
  }
  fs::rename(tmp, path, ec);
  if (ec) {
    const std::string why = ec.message();
    fs::remove(tmp, ec);
    STRATA_THROW(kIo, "cannot write the demo text to {}: {}", path, why);
  }
}

// The demo's engine: ZeRO-3 with weights and optimizer state on NVMe, gradients in pinned
// host memory, one layer gathered at a time (plus one in flight) and one gradient bucket.
EngineConfig demo_engine_config(const std::string& nvme_dir, std::uint64_t layer_numel, int world) {
  EngineConfig c = default_engine_config();
  c.stage = 3;
  c.params.device_fraction = 0;
  c.params.host_fraction = 0;
  c.optimizer.device_fraction = 0;
  c.optimizer.host_fraction = 0;
  c.grads.device_fraction = 0;
  c.grads.host_fraction = 1;
  c.param_nvme_paths = {nvme_dir};
  c.optimizer_nvme_paths = {nvme_dir};
  // One layer as the engine holds it: padded to whole pages of 2048 elements on every rank (the
  // live budget counts padded units: the layer's own count was below one, said in a plan note).
  const std::uint64_t padded = detail::padded_numel(layer_numel, std::max(1, world));
  c.max_live_parameters = padded;
  c.overlap_comm = false;
  c.max_reuse_distance = 0;  // release each layer at once: the cap leaves no room to keep one
  c.prefetch_bucket_size = padded;
  // A layer in one sub-group and one bucket: the sizes are used in whole pages of 2048 elements,
  // rounded down (a layer's own count split each layer into its pages and one page more), the
  // bucket's as a share of every rank's shard.
  c.sub_group_size = detail::padded_numel(layer_numel, 1);
  c.reduce_bucket_size = padded;
  c.param_persistence_threshold = 0;
  c.host_budget_bytes = std::uint64_t(256) << 20;
  return c;
}

}  // namespace train_job
}  // namespace strata
