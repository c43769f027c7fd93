// The training loop strata-train runs (include/strata/trainer.h, train()).
//
// Owns the job's setup (model config, initial weights, data, device, communicator, engine
// config with the command line's overrides), the step loop, and what the user sees: the
// progress line, the per-step JSON log and the final summary table. Only rank 0 prints or
// writes files; every rank runs the same collectives in the same order (the loss all-reduce
// after each step, the gathers of a save), so a rank that returns early would hang the others:
// errors are thrown before the first collective or are fatal for the job.
//
// The embedded demo (no model and no data given) is a small byte-level Llama trained on text
// from a tiny generated grammar, with weights and optimizer state on NVMe and an emulated
// device capped below the size of the fp32 weights, so every tier is exercised in a minute.
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <numbers>
#include <random>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/json_config.h"
#include "cpu/cpu_info.h"
#include "scheduler/layout.h"
#include "strata/comm.h"
#include "strata/error.h"
#include "strata/log.h"
#include "strata/model_data.h"
#include "strata/trace.h"
#include "strata/nvme.h"
#include "strata/trainer.h"

namespace strata {

namespace fs = std::filesystem;

// The demo model: a byte-level Llama (GQA, untied head). ~5.9M parameters, 24 MB in fp32.
ModelConfig demo_model_config() {
  const nlohmann::json j = {{"model_type", "llama"},        {"architectures", {"LlamaForCausalLM"}},
                            {"vocab_size", 256},            {"hidden_size", 256},
                            {"intermediate_size", 688},     {"num_hidden_layers", 8},
                            {"num_attention_heads", 8},     {"num_key_value_heads", 4},
                            {"max_position_embeddings", 512}, {"rms_norm_eps", 1e-5},
                            {"rope_theta", 10000.0},        {"tie_word_embeddings", false},
                            {"hidden_act", "silu"}};
  return parse_model_config(j.dump(), "the demo model");
}

std::string default_scratch_dir(const std::string& name) {
  std::error_code ec;
  const std::string exe = fs::read_symlink("/proc/self/exe", ec).string();
  const std::string build = STRATA_BUILD_DIR;
  if (!ec && exe.starts_with(build + "/")) return build + "/" + name;
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg) return std::string(xdg) + "/strata/" + name;
  if (const char* home = std::getenv("HOME"); home && *home) return std::string(home) + "/.cache/strata/" + name;
  return "/var/tmp/strata-" + name;
}

using Clock = std::chrono::steady_clock;

double lr_at(std::int64_t t, double lr, std::int64_t warmup, std::int64_t total, const std::string& schedule) {
  STRATA_REQUIRE(schedule == "const" || schedule == "cosine", "--lr-schedule '{}': use const or cosine", schedule);
  if (warmup > 0 && t <= warmup) return lr * double(t) / double(warmup);
  if (schedule == "const") return lr;
  const double span = double(std::max<std::int64_t>(1, total - warmup));
  const double progress = std::min(1.0, double(t - warmup) / span);
  return lr * 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
}

namespace {

std::string read_text(const std::string& path, const char* what) {
  std::ifstream f(path, std::ios::binary);
  if (!f) STRATA_THROW(kIo, "{} '{}' cannot be read: {}", what, path, std::strerror(errno));
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void require_file(const std::string& path, const char* flag) {
  std::error_code ec;
  STRATA_REQUIRE(fs::is_regular_file(path, ec), "{} {}: no such file", flag, path);
}

// The nearest folder of `path` (itself or an ancestor) that exists: where a folder for it would
// be created.
fs::path nearest_existing(const std::string& path) {
  std::error_code ec;
  fs::path up = fs::absolute(path, ec).lexically_normal();
  while (!up.empty() && !fs::exists(up, ec) && up != up.root_path()) up = up.parent_path();
  return up;
}

// A folder the run will make (--out, the checkpoints') can be made: some file systems pass the
// write check on an existing ancestor and still refuse the mkdir (/proc, /sys; NFS with root
// squashed), which was found when the model was written, after the whole training. Made now,
// and removed again (the run makes it when it writes there).
void require_creatable_folder(const std::string& flag, const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) return;
  // One level at a time, and only the folders this call made are removed again, each only while
  // empty: never one that was there ("link/../X" is not the lexical X: a folder of the user's was
  // removed), nor one another rank made or filled meanwhile (ranks check the same paths at once;
  // a parent another rank removed is made again).
  std::vector<fs::path> made;
  for (int attempt = 0; attempt < 20; ++attempt) {
    fs::path p;
    ec.clear();
    for (const fs::path& part : fs::path(path)) {
      if (part.empty()) continue;
      p /= part;
      if (fs::create_directory(p, ec)) made.push_back(p);
      else if (ec) break;
    }
    if (ec != std::errc::no_such_file_or_directory) break;
  }
  std::error_code ignored;
  for (auto it = made.rbegin(); it != made.rend(); ++it) fs::remove(*it, ignored);
  if (ec)
    STRATA_THROW(kInvalidArgument, "{} {}: the folder cannot be made there: {}; give a folder on a writable drive", flag,
                 path, ec.message());
}

// Checked before the first step, not when the file is written: `folder` (the file's, or the
// nearest existing ancestor of a folder the run will create) is one this process can write in.
void require_writable_folder(const std::string& flag, const std::string& path, const fs::path& folder) {
  std::error_code ec;
  STRATA_REQUIRE(fs::is_directory(folder, ec), "{} {}: {} is not a folder (create it first)", flag, path,
                 folder.string());
  STRATA_REQUIRE(::access(folder.c_str(), W_OK) == 0, "{} {}: {} cannot be written in: {}", flag, path,
                 folder.string(), std::strerror(errno));
}

std::string demo_text(std::size_t bytes, std::uint64_t seed);

// The demo's text file, written only when it does not hold the text already, and then as a new
// file renamed over the old: another demo run may be reading the old one through mmap, and
// truncating a mapped file kills its reader (SIGBUS).
void write_demo_text(const std::string& path) {
  const std::string t = demo_text(std::size_t(1) << 20, 7);
  std::error_code ec;
  fs::create_directories(fs::path(path).parent_path(), ec);
  STRATA_REQUIRE(!ec, "the demo text's folder {} cannot be created: {}", fs::path(path).parent_path().string(),
                 ec.message());
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

// Sentences from a small grammar: the structure (spelling, word order, agreement of "a"/"an")
// is learnable within tens of steps, and the remaining entropy (which word comes next) keeps
// the loss from collapsing to zero.
std::string demo_text(std::size_t bytes, std::uint64_t seed) {
  static const char* subj[] = {"the cat", "a dog", "the old man", "my friend", "the bird", "a child", "the teacher"};
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

std::string human_bytes(double b) { return log::human_bytes(b, 1); }

std::string hms(double s) {
  const auto t = std::int64_t(std::max(0.0, s) + 0.5);
  return t >= 3600 ? fmt::format("{}:{:02}:{:02}", t / 3600, t / 60 % 60, t % 60) : fmt::format("{}:{:02}", t / 60, t % 60);
}

// The mean of `v` over the ranks (every rank calls it).
double mean_over_ranks(double v, Communicator& comm, Device& dev, Stream& s) {
  if (comm.world_size() == 1) return v;
  Buffer b = dev.alloc(8, &s);
  s.copy(b.ref(), host_ref(&v, 8));
  comm.all_reduce(TensorRef{b.ref(), DType::kF64, 1}, ReduceOp::kSum, s);
  s.copy(host_ref(&v, 8), b.ref());
  s.synchronize();
  return v / comm.world_size();
}

// A setting every rank must share: a rank started with other flags or another config trains
// something else, and its gradients average into the others' without any error.
struct SharedSetting {
  const char* name;
  double value;
};

// Every rank calls it: refuses the job, on every rank alike, when the ranks' settings differ,
// naming the first that does and its value on rank 0 and on the first rank that differs.
void require_same_settings(const std::vector<SharedSetting>& mine, Communicator& comm, Device& dev) {
  if (comm.world_size() == 1) return;
  const std::size_t k = mine.size(), world = std::size_t(comm.world_size());
  std::vector<double> v, all(k * world);
  for (const auto& m : mine) v.push_back(m.value);
  auto s = dev.create_stream("settings");
  Buffer in = dev.alloc(8 * k, s.get()), out = dev.alloc(8 * k * world, s.get());
  s->copy(in.ref(), host_ref(v.data(), 8 * k));
  comm.all_gather(TensorRef{in.ref(), DType::kF64, k}, TensorRef{out.ref(), DType::kF64, k * world}, *s);
  s->copy(host_ref(all.data(), 8 * k * world), out.ref());
  s->synchronize();
  for (std::size_t i = 0; i < k; ++i)
    for (std::size_t r = 1; r < world; ++r)
      STRATA_REQUIRE(all[r * k + i] == all[i],
                     "the ranks were started with different settings: {} is {:g} on rank 0 and {:g} on rank {}; "
                     "start every rank with the same flags and --config",
                     mine[i].name, all[i], all[r * k + i], r);
}

struct Phases {
  double data = 0, forward = 0, backward = 0, optimizer = 0, eval = 0, save = 0;
};

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// --out may already exist when all it holds is the run's checkpoints/ folder.
bool out_dir_free(const std::string& out) {
  std::error_code ec;
  if (!fs::exists(out, ec)) return true;
  if (!fs::is_directory(out, ec)) return false;
  for (const auto& e : fs::directory_iterator(out, ec)) {
    const std::string n = e.path().filename().string();
    // checkpoints/, and the temporary files of a save that was killed (commit_hf_files removes them)
    if (n != "checkpoints" && !n.starts_with(".strata-tmp-")) return false;
  }
  return true;
}

}  // namespace

TrainResult train(const TrainOptions& o) {
  const auto t_start = Clock::now();
  const bool demo_model = o.model_dir.empty() && o.model_config.empty();
  const bool demo_data = o.data_files.empty() && o.text_file.empty();
  STRATA_REQUIRE(o.model_dir.empty() || o.model_config.empty(), "give --model or --model-config, not both");
  STRATA_REQUIRE(o.data_files.empty() || o.text_file.empty(), "give --data or --text, not both");
  STRATA_REQUIRE(demo_model == demo_data || !demo_model,
                 "--data/--text without a model: give --model DIR or --model-config FILE too");
  STRATA_REQUIRE(o.dtype.empty() || o.dtype == "fp32" || o.dtype == "bf16", "--dtype '{}': use fp32 or bf16", o.dtype);
  STRATA_REQUIRE(o.lr_schedule.empty() || o.lr_schedule == "const" || o.lr_schedule == "cosine",
                 "--lr-schedule '{}': use const or cosine", o.lr_schedule);

  // ---- model ----
  ModelConfig mcfg;
  if (!o.model_dir.empty()) {
    std::error_code ec;
    STRATA_REQUIRE(fs::is_directory(o.model_dir, ec), "--model {}: {}", o.model_dir,
                   fs::exists(o.model_dir, ec)
                       ? fmt::format("a file, not a folder: give the folder that holds config.json and the "
                                     "*.safetensors ({})", fs::path(o.model_dir).has_parent_path() ? fs::path(o.model_dir).parent_path().string() : std::string("."))
                       : std::string("no such directory"));
    require_file(o.model_dir + "/config.json", "--model (config.json)");
    mcfg = load_model_config(o.model_dir + "/config.json");
  } else if (!o.model_config.empty()) {
    require_file(o.model_config, "--model-config");
    mcfg = load_model_config(o.model_config);
  } else {
    mcfg = demo_model_config();
  }
  for (const auto& f : o.data_files) require_file(f, "--data");
  if (!o.text_file.empty()) require_file(o.text_file, "--text");
  if (!o.ds_config.empty()) require_file(o.ds_config, "--config");
  if (!o.out_dir.empty()) {
    // Checked now, not after the training: a folder (never a file of the user's, even with
    // --overwrite) under a writable folder.
    std::error_code ec;
    STRATA_REQUIRE(!fs::exists(o.out_dir, ec) || fs::is_directory(o.out_dir, ec),
                   "--out {} is a file, not a folder: give a folder for the model", o.out_dir);
    const fs::path up = nearest_existing(o.out_dir);
    STRATA_REQUIRE(fs::is_directory(up, ec) && ::access(up.c_str(), W_OK) == 0,
                   "--out {}: {} is not a writable folder, so the model could not be written there", o.out_dir,
                   up.string());
    if (!o.overwrite)
      STRATA_REQUIRE(out_dir_free(o.out_dir), "--out {} exists: pass --overwrite to replace it", o.out_dir);
    require_creatable_folder("--out", o.out_dir);
  }
  STRATA_REQUIRE(o.save_every >= 0 && o.keep_checkpoints >= 0, "--save-every and --keep-checkpoints must be >= 0");
  STRATA_REQUIRE(o.save_every == 0 || !o.checkpoint_dir.empty() || !o.out_dir.empty() || !o.resume.empty(),
                 "--save-every needs a folder for the checkpoints: give --checkpoint-dir DIR or --out DIR");
  // Resume: the newest complete checkpoint, found (and verified) before anything is built.
  FoundCheckpoint resume;
  if (!o.resume.empty()) resume = find_checkpoint(o.resume);
  std::vector<std::int64_t> inherited_checkpoints;  // steps, oldest first
  std::string ckpt_root = o.checkpoint_dir;
  if (ckpt_root.empty() && !o.out_dir.empty()) ckpt_root = (fs::path(o.out_dir) / "checkpoints").string();
  if (ckpt_root.empty() && !resume.root.empty()) {
    // --resume named a folder of checkpoints (or a run's): the next resume of it looks there,
    // whatever its step-<N> entries link to.
    ckpt_root = resume.root;
  } else if (ckpt_root.empty() && !resume.dir.empty()) {
    // Beside the resumed one, where it really is: "--resume latest" with latest -> ck/step-2
    // continues in ck/, not beside the link ("P/step-4/" and "step-4" too).
    std::error_code ec;
    fs::path dir = fs::canonical(resume.dir, ec);
    if (ec) dir = fs::absolute(resume.dir).lexically_normal();
    if (dir.filename().empty()) dir = dir.parent_path();
    ckpt_root = dir.parent_path().string();
  }
  // Files written during the run: their folders are checked now, not at the step that writes
  // them (a run that cannot save its checkpoint was lost at that step).
  if (o.save_every > 0) {
    require_writable_folder(o.checkpoint_dir.empty() ? "checkpoints in" : "--checkpoint-dir", ckpt_root,
                            nearest_existing(ckpt_root));
    require_creatable_folder(o.checkpoint_dir.empty() ? "checkpoints in" : "--checkpoint-dir", ckpt_root);
    // This run's step-<N> would replace another run's in that folder (even another model's), and
    // a later --resume of it would take whichever is newest. Only the run the folder's checkpoints
    // come from continues there: one resumed from a checkpoint in it.
    const std::vector<std::string> there = checkpoint_folders(ckpt_root);
    std::error_code ec;
    bool continues = false;
    if (!resume.dir.empty()) {
      const fs::path resumed = fs::canonical(resume.dir, ec);  // links, "P/step-4/", ".."
      continues = !ec && fs::equivalent(resumed.parent_path(), ckpt_root, ec);
      if (!continues && !resume.root.empty()) continues = fs::equivalent(resume.root, ckpt_root, ec);
    }
    STRATA_REQUIRE(there.empty() || continues,
                   "{} {} already holds checkpoints of another run (newest: {}), which this run's would replace: "
                   "continue that run with --resume {}, give another --checkpoint-dir, or remove them",
                   o.checkpoint_dir.empty() ? "the checkpoint folder" : "--checkpoint-dir", ckpt_root,
                   fs::path(there.front()).filename().string(), ckpt_root);
    // A resumed run continues the run: its complete checkpoints up to the resumed step count
    // towards --keep-checkpoints with this run's own (oldest first).
    if (continues)
      for (auto it = there.rbegin(); it != there.rend(); ++it) {
        const std::string name = fs::path(*it).filename().string();
        if (name.find(".old-") != std::string::npos || !fs::exists(fs::path(*it) / "manifest.json", ec)) continue;
        const std::int64_t st = std::stoll(name.substr(5));  // checkpoint_folders: "step-<N>"
        if (st <= resume.step) inherited_checkpoints.push_back(st);
      }
  }
  if (!o.trace_file.empty()) {
    const fs::path parent = fs::absolute(o.trace_file).parent_path();
    require_writable_folder("--trace", o.trace_file, parent);
  }
  if (resume.step > 0) {
    const std::int64_t total = o.steps > 0 ? o.steps : 60;
    // A run killed after its last checkpoint, while writing --out: the same command finishes it
    // (no step left to run, the model is written from the checkpoint).
    const bool only_out = total == resume.step && !o.out_dir.empty();
    STRATA_REQUIRE(total > resume.step || only_out,
                   "--resume {}: the checkpoint is at step {}, and --steps {}{} is not beyond it: --steps counts from "
                   "the run's start, so give more than {} to train on{}",
                   resume.dir, resume.step, total, o.steps > 0 ? "" : " (the default)", resume.step,
                   total == resume.step ? fmt::format(", or write its model with strata-export {} OUT_DIR (or --out "
                                                      "DIR here)", resume.dir)
                                        : std::string());
  }

  // ---- launch, device, communicator ----
  const LaunchInfo launch = init_launch();
  HostDeviceOptions hopt;
  CudaDeviceOptions copt;
  if (o.device_mem_gb > 0) {
    hopt.capacity_bytes = std::size_t(o.device_mem_gb * double(1ull << 30));
    copt.capacity_bytes = hopt.capacity_bytes;
  }
  STRATA_REQUIRE(o.emu_h2d_gbps >= 0 && o.emu_d2h_gbps >= 0 && o.emu_compute_gflops >= 0,
                 "--emu-h2d-gbps, --emu-d2h-gbps and --emu-compute-gflops must be >= 0 (0: unthrottled)");
  hopt.h2d_gbps = o.emu_h2d_gbps;
  hopt.d2h_gbps = o.emu_d2h_gbps;
  hopt.compute_gflops = o.emu_compute_gflops;
  const std::vector<UnitSpec> units = model_units(mcfg);
  std::uint64_t max_unit = 0, total_numel = 0;
  for (const auto& u : units) max_unit = std::max<std::uint64_t>(max_unit, u.numel), total_numel += u.numel;
  if (demo_model && o.device_mem_gb <= 0) {
    // Below the model's fp32 weights (5.94M parameters, 22.7 MiB): one layer gathered at a
    // time plus one in flight, one layer's gradient, the checkpoints and one layer's
    // activations at micro-batch 2 (~17 MB at the peak) fit in 20 MiB.
    hopt.capacity_bytes = std::size_t(20) << 20;
  }

  // ---- engine config: the file (or defaults), then the flags ----
  EngineConfig ecfg;
  std::string demo_dir;
  bool config_batch = false;  // the --config gives train_batch_size: the user's global batch
  if (!o.ds_config.empty()) {
    const std::string text = read_text(o.ds_config, "--config");
    // Parsed here too: a syntax error names the file, and train_batch_size is read from it.
    const config::Json j = config::parse(text, fmt::format("--config {}", o.ds_config));
    {
      // Every rank reads the same file: what it warns of (keys strata does not use, settings it
      // ignores) is said once, by rank 0, not once a rank.
      const log::Quiet quiet(log::Level::kError, launch.rank > 0);
      ecfg = parse_engine_config(text, launch.world_size);
    }
    config_batch = j.is_object() && j.contains("train_batch_size");
  } else if (demo_model) {
    demo_dir = o.demo_nvme_dir.empty() ? default_scratch_dir("demo-nvme") : o.demo_nvme_dir;
    std::error_code ec;
    fs::create_directories(demo_dir, ec);
    STRATA_REQUIRE(!ec, "{}{}: the demo's NVMe folder cannot be created: {}{}",
                   o.demo_nvme_dir.empty() ? "" : "--demo-nvme ", demo_dir, ec.message(),
                   o.demo_nvme_dir.empty() ? "; give another with --demo-nvme DIR" : "");
    std::uint64_t layer = units.size() > 2 ? units[1].numel : max_unit;
    ecfg = demo_engine_config(demo_dir, layer, launch.world_size);
  } else {
    ecfg = default_engine_config();
  }
  const std::int64_t config_train_batch = ecfg.train_batch_size;
  if (o.micro_batch > 0) ecfg.micro_batch_per_gpu = o.micro_batch;
  else if (demo_model && o.ds_config.empty()) ecfg.micro_batch_per_gpu = 2;
  if (o.grad_accum > 0) ecfg.gradient_accumulation_steps = o.grad_accum;
  if (config_batch && (o.micro_batch > 0) != (o.grad_accum > 0)) {
    // One of the two flags: the --config's global batch stays, the other factor follows (as
    // DeepSpeed derives it), instead of silently becoming another batch.
    const bool by_micro = o.micro_batch > 0;
    const std::int64_t given = by_micro ? o.micro_batch : o.grad_accum;
    const std::int64_t per = given * launch.world_size;
    STRATA_REQUIRE(config_train_batch % per == 0,
                   "{} {} x {} rank(s) does not divide train_batch_size {} of --config {}: give {} too, or a value "
                   "that divides it",
                   by_micro ? "--micro-batch" : "--grad-accum", given, launch.world_size, config_train_batch,
                   o.ds_config, by_micro ? "--grad-accum" : "--micro-batch");
    (by_micro ? ecfg.gradient_accumulation_steps : ecfg.micro_batch_per_gpu) = config_train_batch / per;
  }
  ecfg.train_batch_size = ecfg.micro_batch_per_gpu * ecfg.gradient_accumulation_steps * launch.world_size;
  if (config_batch && ecfg.train_batch_size != config_train_batch)
    log::warn("--micro-batch {} x --grad-accum {} x {} rank(s) = {} sequences a step replaces train_batch_size {} of "
              "--config {}", ecfg.micro_batch_per_gpu, ecfg.gradient_accumulation_steps, launch.world_size,
              ecfg.train_batch_size, config_train_batch, o.ds_config);
  if (o.lr >= 0) ecfg.adamw.lr = o.lr;
  else if (demo_model && o.ds_config.empty()) ecfg.adamw.lr = 3e-3;
  if (o.weight_decay >= 0) ecfg.adamw.weight_decay = o.weight_decay;
  else if (o.ds_config.empty()) ecfg.adamw.weight_decay = 0;
  if (!o.dtype.empty()) {
    // The flag replaces the --config's precision, fp16's loss scaling with it (kept, it divided
    // every gradient by a scale the fp32/bf16 loss was never multiplied by: 65536x too small).
    if (ecfg.fp16.enabled)
      log::warn("--dtype {} replaces the --config's fp16 (fp16.enabled): no loss scaling", o.dtype);
    ecfg.fp16.enabled = false;
    ecfg.compute_dtype = o.dtype == "bf16" ? DType::kBF16 : DType::kF32;
  }
  STRATA_REQUIRE(ecfg.compute_dtype == DType::kF32 || ecfg.compute_dtype == DType::kBF16,
                 "the model computes in fp32 or bf16; fp16 (fp16.enabled in --config) is not supported yet: use "
                 "\"bf16\": {{\"enabled\": true}} in --config or --dtype bf16");
  // The schedule: --warmup / --lr-schedule when given, else the --config's scheduler block
  // (DeepSpeed's WarmupLR, WarmupDecayLR, WarmupCosineLR), else constant.
  const bool cli_schedule = o.warmup >= 0 || !o.lr_schedule.empty();
  const std::int64_t warmup = std::max<std::int64_t>(0, o.warmup);
  const bool ds_schedule = !cli_schedule && !ecfg.scheduler.type.empty();
  const std::string schedule = ds_schedule ? ecfg.scheduler.type : o.lr_schedule.empty() ? "const" : o.lr_schedule;
  if (!ecfg.scheduler.type.empty() && cli_schedule)
    log::warn("--config: scheduler '{}' is replaced by --warmup / --lr-schedule", ecfg.scheduler.type);
  if (ecfg.host_budget_bytes == 0) ecfg.host_budget_bytes = default_host_budget(launch.local_size);
  const std::int64_t steps = o.steps > 0 ? o.steps : 60;
  if (ds_schedule && ecfg.scheduler.type != "WarmupLR" && ecfg.scheduler.total_num_steps == 0) {
    // "auto", as Hugging Face fills it: the run's steps.
    STRATA_REQUIRE(steps >= ecfg.scheduler.warmup_num_steps,
                   "--config: scheduler.params.total_num_steps \"auto\" is this run's --steps {}, below its "
                   "warmup_num_steps {}: give more --steps or fewer warmup steps", steps,
                   ecfg.scheduler.warmup_num_steps);
    ecfg.scheduler.total_num_steps = steps;
    log::info("--config: scheduler.params.total_num_steps \"auto\" is this run's --steps, {}", steps);
  }
  // The lr of optimizer step t (1-based).
  const auto lr_of = [&](std::int64_t t) {
    return ds_schedule ? scheduled_lr(ecfg.scheduler, ecfg.adamw.lr, t) : lr_at(t, ecfg.adamw.lr, warmup, steps, schedule);
  };
  // Default: the demo's 128, else 1024 or the model's positions when it has fewer.
  const std::int64_t seq_len = o.seq_len > 0     ? o.seq_len
                               : demo_model      ? 128
                               : mcfg.max_positions > 0 ? std::min<std::int64_t>(1024, mcfg.max_positions)
                                                        : 1024;
  STRATA_REQUIRE(mcfg.arch != ModelArch::kGpt2 || seq_len <= mcfg.max_positions,
                 "--seq-len {} exceeds the model's {} positions", seq_len, mcfg.max_positions);
  // RoPE takes any length, but the model was trained (and its config sized) for this many.
  if (mcfg.arch != ModelArch::kGpt2 && mcfg.max_positions > 0 && seq_len > mcfg.max_positions)
    log::warn("--seq-len {} is beyond the model's max_position_embeddings ({}): positions past it are ones the "
              "model has not seen", seq_len, mcfg.max_positions);
  STRATA_REQUIRE(o.trace_file.empty() || o.trace_step <= steps,
                 "--trace-step {} is after the last step (--steps {}): nothing would be traced; pick a step from 1 "
                 "to {}", o.trace_step, steps, steps);
  const std::int64_t B = ecfg.micro_batch_per_gpu, accum = ecfg.gradient_accumulation_steps;
  const int rank = launch.rank, world = launch.world_size;
  std::FILE* con = rank == 0 ? o.console : nullptr;

  // ---- the plan alone ----
  if (o.plan_only) {
    Engine::check_host_settings(ecfg);  // a plan that says "fits" must not be refused by the run
    auto dev = make_device(o.device, hopt, copt);
    PlanInputs in;
    for (const auto& u : units) in.units.push_back({u.name, u.numel});
    in.world_size = world;
    in.device_capacity = dev->stats().capacity_bytes;
    in.host_capacity = ecfg.host_budget_bytes;
    in.nvme_capacity = nvme_capacity(ecfg, rank, launch.local_size, world);
    in.ranks_on_node = launch.local_size;
    set_host_ram_inputs(in, *dev, launch.local_size);
    MemoryPlan plan = plan_memory(Engine::with_device_defaults(ecfg, *dev), in);
    // The training state only: what a micro-batch's activations take depends on the kernels
    // and is measured, not estimated (a "fits" here can still run out of device memory).
    plan.notes.push_back(fmt::format(
        "activations are not in this plan: a micro-batch of {} x {} tokens needs device memory beyond the "
        "device total above; strata-prof measures them{}",
        ecfg.micro_batch_per_gpu, seq_len, o.checkpoint_activations ? "" : " (--checkpoint-activations keeps them small)"));
    if (!plan.fits && o.device_mem_gb > 0)
      plan.notes.push_back(fmt::format("--device-mem-gb {:g} caps the device: a larger one is another way", o.device_mem_gb));
    if (con) {
      std::fprintf(con, "%s%s, %zu parameters, %zu units, %d rank(s), %s on %s\n%s", mcfg.model_type.c_str(),
                   demo_model ? " (demo)" : "", std::size_t(total_numel), units.size(), world,
                   std::string(dtype_name(ecfg.compute_dtype)).c_str(), dev->name().c_str(), plan.table().c_str());
    }
    TrainResult r;
    r.plan_fits = plan.fits;
    return r;
  }

  // ---- data ----
  std::string text_file = o.text_file;
  if (demo_data) {
    // Beside the demo's NVMe folder, or (a config of the user's with the demo's data) in the
    // scratch folder: never the working directory.
    const std::string dir = demo_dir.empty() ? default_scratch_dir("demo-data") : demo_dir;
    text_file = (fs::path(dir) / "demo-text.txt").string();
    if (rank == 0) write_demo_text(text_file);
    if (rank == 0 && !demo_model)
      log::warn("no --data or --text: training {} on the demo's generated text (a smoke test, not a fine-tune); "
                "give --data FILE or --text FILE for your own", o.model_dir.empty() ? "the model" : o.model_dir);
  }
  DataOptions dopt;
  dopt.files = text_file.empty() ? o.data_files : std::vector<std::string>{text_file};
  dopt.format = text_file.empty() ? parse_token_format(o.data_format) : TokenFormat::kBytes;
  dopt.batch = B;
  dopt.seq_len = seq_len;
  dopt.vocab_size = mcfg.vocab_size;
  dopt.shuffle = o.shuffle;
  dopt.seed = o.seed;
  dopt.val_fraction = o.eval_every > 0 ? 0.1 : 0.0;  // (it shapes the train split: recorded, compared on resume)

  auto dev = make_device(o.device, hopt, copt);
  // Under the demo's 20 MiB cap (set on the emulated device's options above; a GPU runs it uncapped).
  const bool demo_capped = demo_model && o.device_mem_gb <= 0 && dev->kind() == DeviceKind::kCpu;
  auto comm = make_communicator(*dev);
  STRATA_CHECK(comm->rank() == rank && comm->world_size() == world, "the communicator disagrees with the launcher");
  require_same_settings(
      {{"the model's parameter count", double(total_numel)},
       {"the model's layers", double(mcfg.num_layers)},
       {"the model's hidden size", double(mcfg.hidden_size)},
       {"--seq-len", double(seq_len)},
       {"the micro-batch (--micro-batch, train_micro_batch_size_per_gpu)", double(B)},
       {"the accumulation (--grad-accum, gradient_accumulation_steps)", double(accum)},
       {"--steps", double(steps)},
       {"the learning rate (--lr, optimizer.params.lr)", double(ecfg.adamw.lr)},
       {"the weight decay (--weight-decay, optimizer.params.weight_decay)", double(ecfg.adamw.weight_decay)},
       {"--warmup", double(warmup)},
       {"the schedule (0 const, 1 cosine, 2 the --config's)", ds_schedule ? 2.0 : schedule == "cosine" ? 1.0 : 0.0},
       {"the compute dtype (0 fp32, 1 bf16)", ecfg.compute_dtype == DType::kBF16 ? 1.0 : 0.0},
       {"zero_optimization.stage", double(ecfg.stage)},
       {"gradient_clipping", double(ecfg.gradient_clipping)},
       {"--seed", double(o.seed)},
       {"shuffling (--no-shuffle: 0)", o.shuffle ? 1.0 : 0.0},
       {"--checkpoint-activations", o.checkpoint_activations ? 1.0 : 0.0},
       {"--save-every", double(o.save_every)},
       {"--eval-every", double(o.eval_every)},
       // Each rank found its checkpoint on its own (node-local folders, a file one rank could not
       // verify): different steps would mix states and desynchronise the step loop.
       {"the step of the checkpoint --resume found (0: none; give every rank the same --resume DIR/step-<N>)",
        double(resume.step)}},
      *comm, *dev);
  if (demo_data && world > 1) {  // rank 0 wrote the text
    auto bs = dev->create_stream("barrier");
    comm->barrier(*bs);
    bs->synchronize();
  }
  TokenLoader loader(dopt);
  std::unique_ptr<TokenLoader> val;
  if (o.eval_every > 0) val = std::make_unique<TokenLoader>(dopt, DataSplit::kVal);
  std::int64_t train_batches = 0, val_batches = 0;  // next() calls so far: the data position

  // ---- model + engine ----
  auto compute = dev->create_stream("compute");
  ModelOptions mopt;
  mopt.micro_batch = B;
  mopt.seq_len = seq_len;
  mopt.compute = ecfg.compute_dtype;
  mopt.checkpoint = o.checkpoint_activations || o.checkpoint_on_host || demo_model;
  mopt.checkpoint_on_host = o.checkpoint_on_host;
  Model model(mcfg, *dev, *compute, mopt);
  Engine engine(*dev, *comm, ecfg);
  // Each rank's slices computed (from scratch) or read (a Hugging Face folder) where they go.
  add_model_units(engine, model.units(),
                  o.model_dir.empty() ? fresh_model_source(mcfg, o.seed) : hf_model_source(mcfg, o.model_dir));
  try {
    engine.finalize();
  } catch (const Error& e) {
    // Two demos at once: the demo's folder is the flag's, not a config key of the user's.
    if (!demo_dir.empty() && e.user_message().find("in use by another running strata process") != std::string::npos)
      STRATA_THROW(kInvalidArgument, "the demo's NVMe folder {} is in use by another running demo; give this one "
                   "its own with --demo-nvme DIR", demo_dir);
    // The demo runs on a device capped below its weights, which its own config offloads
    // around; a config of the user's may not: say where the cap comes from.
    // A cap of the user's own is one of the things to change.
    if (e.kind() == ErrorKind::kOutOfMemory && o.device_mem_gb > 0)
      STRATA_THROW(kOutOfMemory, "{}\n(--device-mem-gb {:g} caps the device: a larger one is another way)",
                   e.message(), o.device_mem_gb);
    if (e.kind() != ErrorKind::kOutOfMemory || !demo_capped || o.ds_config.empty()) throw;
    STRATA_THROW(kOutOfMemory,
                 "the demo model runs on an emulated device capped at 20 MiB (below its weights), and --config {} "
                 "does not fit it: offload as the message below says, or give a larger device with "
                 "--device-mem-gb\n{}",
                 o.ds_config, e.user_message());
  }
  EngineWeights weights(engine, *compute, model.units());

  // ---- resume ----
  std::int64_t result_resumed_from = 0;
  std::vector<std::string> result_checkpoints;
  const std::string model_hash = model_config_hash(mcfg);
  const std::string model_desc = fmt::format("{} {}x{} {} layers, vocab {}", mcfg.model_type, mcfg.hidden_size,
                                             mcfg.intermediate_size, mcfg.num_layers, mcfg.vocab_size);
  std::int64_t start_step = 0;
  // What else shapes the steps after a checkpoint: recorded, compared on resume.
  const nlohmann::json optimizer_state = {
      {"weight_decay", double(ecfg.adamw.weight_decay)}, {"beta1", double(ecfg.adamw.beta1)},
      {"beta2", double(ecfg.adamw.beta2)},               {"eps", double(ecfg.adamw.eps)},
      {"bias_correction", ecfg.adamw.bias_correction},   {"gradient_clipping", ecfg.gradient_clipping},
      {"compute_dtype", std::string(dtype_name(ecfg.compute_dtype))}};
  if (!resume.dir.empty()) {
    const nlohmann::json& m = resume.manifest;
    const int ck_world = m.value("world_size", -1);
    STRATA_REQUIRE(ck_world == world, "--resume {}: the checkpoint has {} rank{}, this run has {}; resharding is not "
                   "supported yet", resume.dir, ck_world, ck_world == 1 ? "" : "s", world);
    const nlohmann::json t = m.value("trainer", nlohmann::json::object());
    const std::string ck_hash = t.value("model_config_hash", "");
    STRATA_REQUIRE(ck_hash == model_hash, "--resume {}: the checkpoint was taken with a different model ({}, config "
                   "hash {}; this run's: {}, hash {}); resume with the same --model/--model-config", resume.dir,
                   t.value("model", "?"), ck_hash, model_desc, model_hash);
    const nlohmann::json d = t.value("data", nlohmann::json::object());
    auto differs = [&](const char* key, const nlohmann::json& now) {
      if (d.contains(key) && d[key] != now)
        log::warn("--resume: {} was {} in the checkpoint's run, {} now: the data will not continue where it stopped",
                  key, d[key].dump(), now.dump());
    };
    differs("micro_batch", B);
    differs("seq_len", seq_len);
    differs("grad_accum", accum);
    differs("seed", o.seed);
    differs("shuffle", o.shuffle);
    {
      // The same files by another path ("corpus.txt" then "/data/corpus.txt") are the same data.
      auto canon = [](const nlohmann::json& list) {
        std::vector<std::string> out;
        if (!list.is_array()) return out;
        for (const auto& f : list) {
          std::error_code ec;
          const fs::path p = fs::weakly_canonical(fs::path(f.get<std::string>()), ec);
          out.push_back(ec ? f.get<std::string>() : p.string());
        }
        return out;
      };
      if (d.contains("files") && canon(d["files"]) != canon(nlohmann::json(dopt.files)))
        log::warn("--resume: files was {} in the checkpoint's run, {} now: the data will not continue where it "
                  "stopped", d["files"].dump(), nlohmann::json(dopt.files).dump());
    }
    differs("val_fraction", dopt.val_fraction);  // --eval-every takes 10% for validation
    const nlohmann::json ls = t.value("lr_schedule", nlohmann::json::object());
    // The total only shapes a cosine decay: extending a constant-lr run is no change of schedule.
    const bool by_total = !ds_schedule && schedule == "cosine";
    if (ls.value("lr", ecfg.adamw.lr) != double(ecfg.adamw.lr) || ls.value("warmup", warmup) != warmup ||
        ls.value("schedule", schedule) != schedule || (by_total && ls.value("total_steps", steps) != steps) ||
        ls.value("next_lr", lr_of(resume.step + 1)) != lr_of(resume.step + 1))
      log::warn("--resume: the learning-rate schedule differs from the checkpoint's run ({}); continuing with this "
                "run's", ls.dump());
    const nlohmann::json ck_opt = t.value("optimizer", nlohmann::json::object());
    for (const auto& [key, now] : optimizer_state.items())
      if (ck_opt.contains(key) && ck_opt[key] != now)
        log::warn("--resume: {} was {} in the checkpoint's run, {} now: the steps after the checkpoint will not be "
                  "those of the run that wrote it (give the same --config / flags to continue it exactly)",
                  key, ck_opt[key].dump(), now.dump());
    engine.load_state(resume.dir);
    // The data position: replay the loaders' batches (their order is a function of the seed).
    const std::int64_t tb = d.value("train_batches", std::int64_t(0)), vb = d.value("val_batches", std::int64_t(0));
    for (; train_batches < tb; ++train_batches) loader.next();
    if (val)
      for (; val_batches < vb; ++val_batches) val->next();
    start_step = resume.step;
    result_resumed_from = start_step;
    if (con) {
      std::fprintf(con, "resumed from %s (step %lld)\n", resume.dir.c_str(), (long long)start_step);
      std::fflush(con);
    }
  }
  // The name of the temporary checkpoint folders: rank 0's pid, the same on every rank.
  std::string tmp_tag = std::to_string(::getpid());
  if (o.save_every > 0 && world > 1) {
    double pid = rank == 0 ? double(::getpid()) : 0.0;
    pid = mean_over_ranks(pid, *comm, *dev, *compute) * world;
    tmp_tag = std::to_string(std::int64_t(std::llround(pid)));
  }
  // `log_line`: the step's --log-json line, so that a resume from this checkpoint can write it
  // when the run died before it did.
  auto trainer_state = [&](std::int64_t step, const nlohmann::json& log_line) {
    return nlohmann::json{
        {"step", step},
        {"log_line", log_line},
        {"model_config_hash", model_hash},
        // The model's config.json, so that a checkpoint alone can be exported (strata-export).
        {"model_config", nlohmann::json::parse(model_config_json(mcfg))},
        {"model", model_desc},
        {"world_size", world},
        {"data",
         {{"train_batches", train_batches}, {"val_batches", val_batches}, {"epoch", loader.epoch()},
          {"micro_batch", B}, {"seq_len", seq_len}, {"grad_accum", accum}, {"seed", o.seed},
          {"shuffle", o.shuffle}, {"files", dopt.files}, {"val_fraction", dopt.val_fraction}}},
        // The only randomness after initialisation is the loaders' shuffle, seeded by `seed`
        // per epoch: the position above restores it.
        {"rng", {{"init_seed", o.seed}, {"shuffle_seed", o.seed}}},
        {"lr_schedule",
         {{"lr", double(ecfg.adamw.lr)}, {"warmup", warmup}, {"total_steps", steps},
          {"schedule", schedule}, {"next_step", step + 1}, {"next_lr", lr_of(step + 1)}}},
        {"optimizer", optimizer_state},
        {"loss_scale", engine.loss_scale()}};
  };
  std::vector<std::int64_t> saved_steps = inherited_checkpoints;
  auto save_checkpoint = [&](std::int64_t step, const nlohmann::json& log_line) {
    std::string dir;
    try {
      dir = write_checkpoint(engine, *comm, *compute, ckpt_root, step, tmp_tag, trainer_state(step, log_line));
    } catch (const Error& e) {
      // A file that could not be written (a full drive): say what is left and what to do
      // (write_checkpoint removed the half-written folder). Other errors pass as they are.
      if (e.kind() != ErrorKind::kIo) throw;
      const std::string newest = !result_checkpoints.empty() ? result_checkpoints.back() : resume.dir;
      STRATA_THROW(kIo, "{}; the checkpoint of step {} was not written and nothing of it is left; {}; free space in "
                   "{} (or give another --checkpoint-dir), then run the same command{}", e.message(),
                   step, newest.empty() ? std::string("no checkpoint of this run is complete")
                                        : fmt::format("the newest complete one is {}", newest),
                   ckpt_root,
                   newest.empty() ? std::string(" again (there is nothing to --resume from)")
                                  : fmt::format(" with --resume {}", newest));
    }
    result_checkpoints.push_back(dir);
    saved_steps.push_back(step);
    if (rank == 0)  // what Ctrl-C (or a scheduler's SIGTERM) says from now on
      set_interrupt_note(fmt::format("\nstrata-train: interrupted; the newest checkpoint is {} (step {}): continue "
                                     "with the same command and --resume {}\n", dir, step, ckpt_root));
  };
  // Older complete checkpoints of the run beyond the newest keep_checkpoints: after the step's
  // log line (a removal of ~100 MiB takes a while, and the line must not wait behind it).
  auto prune_checkpoints = [&] {
    if (rank != 0 || o.keep_checkpoints == 0) return;
    while (saved_steps.size() > std::size_t(o.keep_checkpoints)) {
      std::error_code ec;
      fs::remove_all(fs::path(ckpt_root) / fmt::format("step-{}", saved_steps.front()), ec);
      saved_steps.erase(saved_steps.begin());
    }
  };

  std::unique_ptr<std::ofstream> jlog;
  if (rank == 0 && !o.log_json.empty()) {
    // Resumed: keep the log's lines up to the checkpoint's step and continue after them.
    std::string kept;
    if (start_step > 0) {
      std::ifstream old(o.log_json);
      std::string line;
      bool has_start = false, has_earlier = false;
      while (std::getline(old, line)) {
        try {
          const std::int64_t at = nlohmann::json::parse(line).value("step", std::int64_t(0));
          if (at <= start_step) kept += line + "\n";
          has_start = has_start || at == start_step;
          has_earlier = has_earlier || at < start_step;
        } catch (const std::exception&) {
          break;  // a torn last line of the killed run
        }
      }
      // The run's own log, which it died before writing the checkpoint's line to: the checkpoint
      // has the line. (A new log of the resumed run starts after the checkpoint, as ever.)
      const nlohmann::json t = resume.manifest.value("trainer", nlohmann::json::object());
      if (has_earlier && !has_start && t.contains("log_line") && t["log_line"].is_object())
        kept += t["log_line"].dump() + "\n";
    }
    jlog = std::make_unique<std::ofstream>(o.log_json, std::ios::trunc);
    *jlog << kept;
    if (!*jlog) STRATA_THROW(kIo, "--log-json {} cannot be written: {}", o.log_json, std::strerror(errno));
  }
  // Under an MPI launcher stdout is a pseudo-terminal the launcher forwards, wherever its own
  // output goes (a file got "\r\x1b[K" for every step): plain lines there.
  const bool tty = con && ::isatty(::fileno(con)) && !launch.under_mpi;
  const std::int64_t print_every = std::max<std::int64_t>(1, steps / 20);
  const double tokens_per_step = double(B * seq_len * accum * world);
  if (con) {
    std::string on = dev->name();  // the emulated device's name says its cap already
    if (on.find("(cap ") == std::string::npos) on += " (cap " + human_bytes(double(dev->stats().capacity_bytes)) + ")";
    std::fprintf(con, "strata-train: %s%s, %.2fM parameters, %s, %d rank(s) on %s\n", mcfg.model_type.c_str(),
                 demo_model ? " (embedded demo)" : "", double(model.num_params()) / 1e6,
                 std::string(dtype_name(ecfg.compute_dtype)).c_str(), world, on.c_str());
    // "device", "host", "nvme", or the split ("device 70% + host 30%"; it said "nvme" for any split).
    const auto where = [](const Placement& p) {
      std::vector<std::string> parts;
      const std::pair<const char*, double> tiers[] = {
          {"device", p.device_fraction}, {"host", p.host_fraction}, {"nvme", p.nvme_fraction()}};
      for (const auto& [name, f] : tiers)
        if (f > 1e-9) parts.push_back(f >= 1 - 1e-9 ? std::string(name) : fmt::format("{} {:.0f}%", name, f * 100));
      return fmt::format("{}", fmt::join(parts, " + "));
    };
    // The split as placed: units are placed whole (by where their first byte falls), so a
    // fraction is met only as nearly as the units allow — the plan's bytes say how nearly.
    const auto placed = [&](const char* prefix, const Placement& asked) {
      double bytes[3] = {}, total = 0;
      for (const PlanLine& l : engine.plan().lines)
        if (l.what.starts_with(prefix)) bytes[int(l.tier)] += double(l.bytes), total += double(l.bytes);
      if (total <= 0) return where(asked);
      const Placement got{bytes[0] / total, bytes[1] / total};
      std::string said = where(got);
      if (std::abs(got.device_fraction - asked.device_fraction) > 0.005 ||
          std::abs(got.host_fraction - asked.host_fraction) > 0.005)
        said += fmt::format(" ({} asked; units are placed whole)", where(asked));
      return said;
    };
    std::fprintf(con, "  stage %d; weights on %s, optimizer on %s, gradients on %s; batch %lld x %lld tokens x %lld "
                      "accum x %d ranks\n",
                 ecfg.stage, placed("compute weights (", ecfg.params).c_str(),
                 placed("optimizer state (", ecfg.optimizer).c_str(), placed("gradient shard", ecfg.grads).c_str(),
                 (long long)B, (long long)seq_len, (long long)accum, world);
    std::string data = text_file.empty() ? fmt::format("{}", fmt::join(o.data_files, ", ")) : text_file;
    if (demo_data) data += " (the demo's generated text: no --data or --text given)";
    if (!demo_dir.empty()) std::fprintf(con, "  NVMe folder: %s\n", demo_dir.c_str());
    std::fprintf(con, "  data: %s\n", data.c_str());
    std::fflush(con);
  }

  TrainResult result;
  result.resumed_from = result_resumed_from;
  Phases ph;
  EngineStats prev = engine.stats();
  if (rank == 0)  // an interrupted run said nothing; now it says where it can go on from
    set_interrupt_note(
        !resume.dir.empty()
            ? fmt::format("\nstrata-train: interrupted; the newest checkpoint is {} (step {}): continue with the same "
                          "command\n", resume.dir, resume.step)
        : o.save_every > 0
            ? std::string("\nstrata-train: interrupted before its first checkpoint: nothing to resume from\n")
            : std::string("\nstrata-train: interrupted; no checkpoints were written (--save-every N keeps a run's "
                          "progress)\n"));
  const auto loop_start = Clock::now();
  for (std::int64_t step = start_step + 1; step <= steps; ++step) {
    const auto t_step = Clock::now();
    const bool tracing = !o.trace_file.empty() && step == o.trace_step;
    if (tracing) Tracer::global().set_enabled(true);
    const double lr = lr_of(step);
    engine.set_next_lr(float(lr));  // the early optimizer step (overlapping backward) uses it
    double loss_sum = 0;
    for (std::int64_t a = 0; a < accum; ++a) {
      auto t0 = Clock::now();
      Batch batch;
      for (int r = 0; r < world; ++r) {
        Batch b = loader.next();
        ++train_batches;
        if (r == rank) batch = std::move(b);
      }
      ph.data += since(t0);
      try {
        t0 = Clock::now();
        loss_sum += double(model.forward(batch, weights));
        ph.forward += since(t0);
        t0 = Clock::now();
        model.backward(weights);
        compute->synchronize();
        ph.backward += since(t0);
      } catch (const Error& e) {
        // The plan covered the training state; what did not fit is a micro-batch's work.
        if (e.kind() != ErrorKind::kOutOfMemory) throw;
        // The pinned pool's budget (its errors begin "pinned pool:"), not the device's.
        if (e.message().rfind("pinned pool:", 0) == 0)
          STRATA_THROW(kOutOfMemory,
                       "step {}: pinned host memory ran out during a micro-batch: raise strata.host_budget_bytes in "
                       "--config (the plan's host total is {} bytes; the pool commits whole 2 MiB pieces) ({})",
                       step, engine.plan().host_bytes, e.user_message());
        STRATA_THROW(kOutOfMemory,
                     "step {}: the device ran out of memory during a micro-batch (its activations are not in the "
                     "plan): a smaller --micro-batch (now {}) or --seq-len (now {}){}{}, or fewer weights on the "
                     "device (--config: offload_param, stage3_max_live_parameters) ({})",
                     step, B, seq_len,
                     mopt.checkpoint ? "" : ", --checkpoint-activations (or --checkpoint-on-host)",
                     demo_capped
                         ? ", a larger --device-mem-gb (the demo model's emulated device is capped at 20 MiB, "
                           "below its weights)"
                     : dev->kind() == DeviceKind::kCpu || o.device_mem_gb > 0 ? ", a larger --device-mem-gb"
                                                                              : "",
                     e.user_message());
      }
    }
    auto t0 = Clock::now();
    const StepResult sr = engine.step(float(lr));
    ph.optimizer += since(t0);
    const double loss = mean_over_ranks(loss_sum / double(accum), *comm, *dev, *compute);
    if (tracing) {
      Tracer::global().set_enabled(false);
      if (rank == 0) {
        try {
          Tracer::global().write_chrome_trace(o.trace_file);
        } catch (const Error& e) {  // a debugging aid: not worth the run
          log::warn("--trace: {}; the training goes on", e.user_message());
        }
      }
    }
    StepRecord rec;
    rec.step = step;
    rec.loss = loss;
    rec.lr = lr;
    rec.grad_norm = sr.grad_norm;
    rec.skipped = sr.skipped;
    rec.step_s = since(t_step);
    rec.tokens_per_s = tokens_per_step / rec.step_s;
    result.steps.push_back(rec);

    double val_loss = NAN;
    if (val && step % o.eval_every == 0) {
      t0 = Clock::now();
      double sum = 0;
      engine.set_eval(true);  // the training's recorded unit order stays as it is
      for (std::int64_t i = 0; i < o.eval_batches; ++i) {
        Batch vb;
        for (int r = 0; r < world; ++r) {
          Batch b = val->next();
          ++val_batches;
          if (r == rank) vb = std::move(b);
        }
        sum += double(model.forward(vb, weights, /*grad=*/false));
      }
      engine.set_eval(false);
      val_loss = mean_over_ranks(sum / double(o.eval_batches), *comm, *dev, *compute);
      ph.eval += since(t0);
    }

    const EngineStats st = engine.stats();
    nlohmann::json j = {{"step", step},          {"loss", loss},           {"lr", lr},
                        {"grad_norm", sr.grad_norm}, {"tokens_per_s", rec.tokens_per_s},
                        {"step_time_s", rec.step_s}, {"skipped", sr.skipped}, {"loss_scale", sr.loss_scale},
                        {"h2d_bytes", st.h2d_bytes - prev.h2d_bytes}, {"d2h_bytes", st.d2h_bytes - prev.d2h_bytes},
                        {"nvme_read_bytes", st.nvme_read_bytes - prev.nvme_read_bytes},
                        {"nvme_written_bytes", st.nvme_written_bytes - prev.nvme_written_bytes}};
    if (!std::isnan(val_loss)) j["val_loss"] = val_loss;

    // The checkpoint before the step's log line: a logged step's checkpoint is complete. The line
    // is in the checkpoint too, for a resume after a death between the two.
    const bool checkpointed = o.save_every > 0 && (step % o.save_every == 0 || step == steps);
    if (checkpointed) {
      t0 = Clock::now();
      save_checkpoint(step, j);
      ph.save += since(t0);
      if (const char* crash = std::getenv("STRATA_TEST_CRASH_AFTER_CHECKPOINT");
          crash && std::atoll(crash) == step && rank == 0) {
        std::fprintf(stderr, "strata-train: STRATA_TEST_CRASH_AFTER_CHECKPOINT=%lld: aborting before the step's log "
                     "line\n", (long long)step);
        std::fflush(stderr);
        std::abort();
      }
    }

    if (jlog) {
      *jlog << j.dump() << '\n';
      jlog->flush();
      if (!*jlog) {  // a full drive: the run goes on, but the log is said to be incomplete
        log::warn("--log-json {}: the line of step {} could not be written ({}); the log stops here, the run goes "
                  "on", o.log_json, step, std::strerror(errno));
        jlog.reset();
      }
    }
    if (checkpointed) prune_checkpoints();
    if (con) {
      const double gbps = 1e-9 / rec.step_s;
      const double elapsed = since(loop_start);
      const std::string line = fmt::format(
          "step {}/{}  loss {:.4f}{}  {:.0f} tok/s  {:.2f} s/step  h2d {:.2f} d2h {:.2f} nvme r {:.2f} w {:.2f} GB/s  ETA {}",
          step, steps, loss, std::isnan(val_loss) ? std::string() : fmt::format(" (val {:.4f})", val_loss),
          rec.tokens_per_s, rec.step_s, double(st.h2d_bytes - prev.h2d_bytes) * gbps,
          double(st.d2h_bytes - prev.d2h_bytes) * gbps, double(st.nvme_read_bytes - prev.nvme_read_bytes) * gbps,
          double(st.nvme_written_bytes - prev.nvme_written_bytes) * gbps,
          hms(elapsed / double(step - start_step) * double(steps - step)));
      const bool keep = step == 1 || step == steps || step % print_every == 0 || !std::isnan(val_loss);
      if (tty) std::fprintf(con, "\r\x1b[K%s%s", line.c_str(), keep ? "\n" : "");
      else if (keep) std::fprintf(con, "%s\n", line.c_str());
      std::fflush(con);
    }
    prev = st;
  }

  if (!o.out_dir.empty()) {
    const auto t0 = Clock::now();
    if (rank == 0 && o.overwrite) {  // a file where the folder goes; in a folder, the save
      std::error_code ec;          // replaces the weights and config.json, and other files stay
      if (fs::exists(o.out_dir, ec) && !fs::is_directory(o.out_dir, ec)) fs::remove(o.out_dir, ec);
    }
    try {
      save_engine_weights(engine, mcfg, ecfg.compute_dtype, o.out_dir, rank);
    } catch (const Error& e) {
      // A full drive at the end: the training is in the newest checkpoint, if any; say so, and how to
      // finish (the same command with --resume writes the model and runs no step).
      if (e.kind() != ErrorKind::kIo) throw;
      const std::string newest = !result_checkpoints.empty() ? result_checkpoints.back() : resume.dir;
      STRATA_THROW(kIo, "{}; the model was not written to {}; {}", e.message(), o.out_dir,
                   newest.empty() ? std::string("no checkpoint of this run holds its training (--save-every N keeps "
                                                "it): free space there and run again")
                                  : fmt::format("the newest checkpoint is {}: free space there, then run the same "
                                                "command with --resume {}", newest, newest));
    }
    ph.save += since(t0);
  }
  result.stats = engine.stats();
  result.checkpoints = result_checkpoints;

  if (con) {
    const EngineStats& s = result.stats;
    const double total = since(t_start);
    // A resumed run says which steps it ran (it said "9 steps" for steps 7-9).
    const std::string ran = start_step >= steps ? fmt::format("resumed at step {}: no step left", start_step)
                            : start_step > 0 && start_step + 1 == steps ? fmt::format("step {} of {}, resumed", steps, steps)
                            : start_step > 0   ? fmt::format("steps {}-{} of {}, resumed", start_step + 1, steps, steps)
                                               : fmt::format("{} step{}", steps, steps == 1 ? "" : "s");
    // No step run (resumed at the last step): the checkpoint's loss, when its log line is there.
    std::string final_loss;
    if (!result.steps.empty()) {
      final_loss = fmt::format(", final loss {:.4f}", result.steps.back().loss);
    } else if (const nlohmann::json line = resume.manifest.value("trainer", nlohmann::json::object())
                                               .value("log_line", nlohmann::json::object());
               line.contains("loss") && line["loss"].is_number()) {
      final_loss = fmt::format(", loss {:.4f} at the checkpoint", line["loss"].get<double>());
    }
    std::fprintf(con, "\nsummary (%s, %.1f s, %.0f tokens/s%s)\n", ran.c_str(), total,
                 tokens_per_step * double(steps - start_step) / since(loop_start), final_loss.c_str());
    std::fprintf(con, "  %-12s %9s\n", "phase", "seconds");
    const std::pair<const char*, double> rows[] = {{"data", ph.data},           {"forward", ph.forward},
                                                   {"backward", ph.backward},   {"optimizer", ph.optimizer},
                                                   {"eval", ph.eval},           {"save", ph.save}};
    for (const auto& [n, v] : rows) std::fprintf(con, "  %-12s %9.2f\n", n, v);
    std::fprintf(con, "  %-8s %-22s %-22s\n", "tier", "moved", "peak / capacity");
    std::fprintf(con, "  %-8s %-22s %-22s\n", "device",
                 fmt::format("in {} out {}", human_bytes(double(s.h2d_bytes)), human_bytes(double(s.d2h_bytes))).c_str(),
                 fmt::format("{} / {}", human_bytes(double(s.device_peak_bytes)), human_bytes(double(s.device_capacity))).c_str());
    std::fprintf(con, "  %-8s %-22s %-22s\n", "host", "(staging of the above)",
                 fmt::format("{} / {}", human_bytes(double(s.host_pinned_peak_bytes)),
                             human_bytes(double(s.host_budget_bytes))).c_str());
    std::fprintf(con, "  %-8s %-22s %-22s\n", "nvme",
                 fmt::format("read {} written {}", human_bytes(double(s.nvme_read_bytes)),
                             human_bytes(double(s.nvme_written_bytes))).c_str(),
                 fmt::format("{} held", human_bytes(double(s.nvme_bytes))).c_str());
    // The process's resident memory at its peak, beside what the plan counted for it.
    std::fprintf(con, "  %-8s %-22s %-22s\n", "ram", "(the process, peak)",
                 fmt::format("{} / {} planned", human_bytes(double(cpu::process_peak_rss_bytes())),
                             human_bytes(double(engine.plan().ram_bytes))).c_str());
    if (s.early_units_kept + s.early_units_redone > 0)
      std::fprintf(con,
                   "  early optimizer step: %llu unit updates kept (%llu finished under the next forward), "
                   "%llu redone (clipping, overflow, lr), %llu steps without it (backing off after redone ones)\n",
                   (unsigned long long)s.early_units_kept, (unsigned long long)s.early_units_finished_behind,
                   (unsigned long long)s.early_units_redone, (unsigned long long)s.early_steps_skipped);
    if (s.device_alloc_waits > 0)  // (what is on already is not offered: the demo checkpoints)
      std::fprintf(con,
                   "  device memory full: %llu allocations waited for frees still queued on streams (%llu per "
                   "step); a smaller micro-batch%s or, where weights are gathered on use, a smaller "
                   "stage3_max_live_parameters avoids the stalls%s\n",
                   (unsigned long long)s.device_alloc_waits,
                   (unsigned long long)(s.device_alloc_waits / std::uint64_t(std::max<std::int64_t>(1, steps - start_step))),
                   mopt.checkpoint ? "" : ", activation checkpointing (--checkpoint-activations)",
                   demo_model ? " (expected in the demo: its cap is below its weights)" : "");
    if (!o.out_dir.empty()) std::fprintf(con, "model written to %s\n", o.out_dir.c_str());
    if (!result_checkpoints.empty())
      std::fprintf(con, "checkpoints in %s (newest: %s)\n", ckpt_root.c_str(), result_checkpoints.back().c_str());
    std::fflush(con);
  }
  return result;
}

}  // namespace strata
